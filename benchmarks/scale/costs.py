"""Prices of forwards, collectives and the lane's rounds, from one profile.

- A rank's forward: `t0 + bytes * s_per_byte + flops * s_per_flop` (`profile.Costs`), its bytes
  and FLOPs from `shape.batch_work` with the expert-parallel group's tokens.
- Expert parallelism over `ep` ranks (vLLM's all-gather / reduce-scatter dispatch, the one the lane
  accepts at DP > 1): per MoE layer one all-gather of every rank's hidden states and one
  reduce-scatter back, each `collective_latency + (ep - 1) * hop_latency + (ep - 1) / ep *
  group_tokens * hidden * act_bytes / bandwidth` (a ring of ep - 1 hops), with the node's link
  bandwidth and hop latency up to `gpus_per_node` ranks and the inter-node ones beyond. The fixed
  `collective_latency` (with the step's DP synchronisation folded in) is fitted to the DP=2
  decode steps of the 2 x H200 rollout's records; hops and bandwidths are stated, not fitted.
- A forward's time is its device time or its graph mode's host floor, whichever is longer
  (`profile.Costs`).
- Lockstep: DP ranks with expert parallelism meet in every MoE layer, so a step lasts as long as
  its slowest rank (vLLM runs dummy forwards on idle ranks to keep them in step).
- TP within a rank's replica splits its work evenly (the CPU layouts only); on a CPU profile,
  ranks beyond the machine's cores share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.scale.profile import Profile, graph_mode
from benchmarks.scale.shape import Batch, batch_work


@dataclass(frozen=True)
class Layout:
    """`dp` attention replicas (engines), `tp` ranks each, experts over all `dp * tp` ranks when
    `ep` (vLLM's --enable-expert-parallel)."""

    dp: int = 1
    tp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"dp={self.dp} and tp={self.tp} must be >= 1")

    @property
    def ranks(self) -> int:
        return self.dp * self.tp

    @property
    def ep_size(self) -> int:
        return self.ranks if self.ep else self.tp

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} ep={'on' if self.ep else 'off'}"


class CostModel:
    def __init__(self, profile: Profile, layout: Layout) -> None:
        self.profile = profile
        self.layout = layout
        self.shape = profile.shape
        self.c = profile.costs
        hw = profile.hardware
        cores = int(hw.get("cores") or 0)
        # A CPU profile is measured with one process on all cores; more ranks share them.
        self.host_share = max(1.0, layout.ranks / cores) if cores else 1.0
        self.lane = profile.lane
        self.capture = profile.capture

    def forward(self, batch: Batch, group_tokens: float, with_t0: bool = True) -> float:
        """Seconds of one rank's forward (no collectives)."""
        lay = self.layout
        if batch.empty and group_tokens == 0:
            return 0.0
        w = batch_work(self.shape, batch, group_tokens, ep=max(1, lay.ep_size // lay.tp),
                       tp=lay.tp)
        if not with_t0:  # P's forward beside D: its device time alone (its host is the lane's)
            return self.c.device(w, with_t0=False) * self.host_share
        return self.c.forward(w, graph_mode(batch, self.capture)) * self.host_share

    def collectives(self, group_tokens: float) -> float:
        """Expert-parallel dispatch and combine of one forward, all MoE layers."""
        ep = self.layout.ep_size if self.layout.ep else 1
        if ep <= 1 or group_tokens <= 0:
            return 0.0
        hw = self.profile.hardware
        inter = ep > hw["gpus_per_node"]
        gbps = hw["inter_node_gbps"] if inter else hw["link_gbps"]
        hop = hw["inter_node_hop_us"] if inter else hw["hop_latency_us"]
        volume = (ep - 1) / ep * group_tokens * self.shape.hidden * self.shape.act_bytes
        one = (hw["collective_latency_us"] + (ep - 1) * hop) * 1e-6 + volume / (gbps * 1e9)
        return 2 * self.shape.moe_layers * one

    def lockstep(self, batches: Sequence[Batch], with_t0: bool = True) -> float:
        """One forward of every DP rank together: the slowest rank plus the collectives. With
        expert parallelism an idle rank runs a dummy forward; without it ranks do not wait."""
        if self.layout.ep and self.layout.dp > 1:
            group = sum(b.tokens for b in batches)
            if group == 0:
                return 0.0
            slowest = max(self.forward(b if not b.empty else Batch(rows=1), group, with_t0)
                          for b in batches)
            return slowest + self.collectives(group)
        return max((self.forward(b, b.tokens, with_t0) for b in batches), default=0.0)

    def rendezvous(self) -> float:
        """The lane's two rendezvous of a round (pre-D and post-D)."""
        table = self.lane["rendezvous_s"]
        n = self.layout.ranks
        keys = sorted(int(k) for k in table)
        key = next((k for k in keys if k >= n), keys[-1])
        return 2.0 * float(table[str(key)])
