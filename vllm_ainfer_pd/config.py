"""The plugin's one typed config, read from vLLM's `--additional-config '{"ainfer_pd": {...}}'`.

Invalid settings fail when the engine config is built (in the process that parses the CLI or calls
`LLM(...)`), with a message that names the bad key or value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MODES = ("pd", "normal")
ORDERINGS = ("fine", "global-enqueue", "global-complete", "free")
SEGMENT_POLICIES = ("fixed", "load", "work")
RENDEZVOUS = ("auto", "shm", "gloo")
P_HOSTS = ("auto", "concurrent", "handoff")
D_STREAM_PRIORITIES = ("default", "high")
P_STREAM_MARKS = ("segment", "layer", "sublayer")


CONFIG_KEY = "ainfer_pd"  # the plugin's key in vLLM's additional_config


class ConfigError(Exception):
    """Not a ValueError on purpose: pydantic (VllmConfig) would fold a ValueError into a multi-line
    ValidationError; this one reaches the user as one line."""


@dataclass(frozen=True)
class AInferPDConfig:
    """`mode="pd"`: the product, P/D multiplexing on. `mode="normal"`: the same engine, kernels and
    classes with P/D multiplexing off (the paper's matched baseline, for layouts stock vLLM cannot
    run).
    """

    mode: str = "pd"
    # The P lane (docs/planner.md): prompts with at least this many uncached tokens are prefilled in
    # the background into reserved KV blocks; shorter ones run inline in the step's batch. Unset:
    # by layout (`lane_min_tokens`).
    p_lane_min_tokens: int | None = None
    # Cap on background prefills in flight; async loads do not count against max_num_seqs. 16, not
    # 4: with 4, a burst of long prompts (a rollout's first turns) is admitted 4 at a time, behind
    # each promotion, and its prefill finished ~20% later than stock's on 1 x H200; with 16 its
    # p99 TTFT is within 5% of stock's (benchmarks/RESULTS.md).
    max_p_inflight: int = 16
    # The turnstile in the worker (docs/worker.md): how D is ordered against a P epoch (the
    # ordering ladder), how many layer boundaries one release lets P pass (K, or chosen per round
    # from D occupancy and P pressure), the CPU rendezvous between ranks, and the bound on every
    # distributed wait (a hang becomes an error naming the rank and what it waited for).
    # `free` (an engine of one rank only): P runs each epoch through without parking.
    ordering: str = "fine"
    # `load` is what the GPU benchmarks measured as `pd` (benchmarks/RESULTS.md);
    # `segment_span` is K for `fixed` only.
    segment_policy: str = "load"
    segment_span: int = 1
    # `auto` picks from where the ranks run (docs/turnstile.md): shared memory on one host, shared
    # memory within each host and gloo between hosts' leaders across several, gloo alone when each
    # host holds one rank. `shm` insists on one host; `gloo` always uses gloo.
    rendezvous: str = "auto"
    timeout_s: float = 120.0
    # GPU benchmarks: time P's segments and D's iterations with CUDA events and export how much of
    # P's device time D overlapped (`vllm_ainfer_pd_p_overlap_seconds`). Off: no events at all.
    overlap_timing: bool = False
    # Where P's host work for a released segment runs (docs/worker.md): `concurrent` beside D's
    # step (D waits for P's stop at the next round), `handoff` while D's thread waits; `auto` is
    # concurrent on GPU, where that work is kernel launches, and the hand-off on CPU, where it is
    # P's compute.
    p_host: str = "auto"
    # GPU only: `high` moves vLLM's compute stream (D's graph replays and eager kernels) to CUDA's
    # highest stream priority, so where D and P both have thread blocks waiting for SMs the
    # hardware dispatches D's first; P's stream keeps the default, lowest priority. `default`
    # leaves both streams equal (stock vLLM's stream). Not the default: on 1 x H200 `high` gained
    # nothing beyond run-to-run spread (benchmarks/RESULTS.md).
    d_stream_priority: str = "default"
    # GPU only: how P's kernels are issued on P's stream. `segment`: a released segment's layers
    # back to back. `layer`: a timing event recorded on P's stream after every layer (at each
    # attention boundary). `sublayer`: also one after each layer's attention, before its MLP or
    # MoE. In the lane on an H100 the three ran D and P together equally fast (~1.5x their rates
    # apart, benchmarks/RESULTS.md), so the default records nothing.
    p_stream_marks: str = "segment"
    # GPU only: 0 lets P's kernels take any SM. N > 0 runs P's stream in a CUDA green context
    # of N SMs (`torch.cuda.GreenContext`), so P never holds more than N SMs and D's kernels
    # always find the others free. Not yet run on a GPU (`benchmarks/lane_contention.py
    # --p-sm-count N` measures it against the plain stream); not the default.
    p_sm_count: int = 0
    # Phase-owned DeepEP (docs/deepep.md): the SMs P's normal-mode dispatch and combine kernels
    # take (DeepEP runs one channel per two SMs, so it must be even). Low, so that D's
    # low-latency kernels, launched beside them, still find SMs: 24 of an H200's 132. Checked
    # against the device's SM count when the worker builds the buffers.
    p_deepep_sms: int = 24
    # The epoch gate at DP > 1 (docs/turnstile.md, the round plan): P epochs run in lockstep over
    # the DP ranks, so a round opens one only once the lane tokens queued over the ranks in play
    # (those with lane work or decode rows) fill `epoch_gate_fill` of (their count x
    # max_num_batched_tokens), or the oldest has waited `epoch_gate_rounds` D iterations, or no
    # rank has decode rows. 0 opens at once (no gate). 0.8 / 96: the scale model's choice over
    # fills 0.5-0.9 and deadlines 32-128 (within 2.5% of the best at DP 2-8 and at DeepSeek-V3
    # size, projected), and the setting checked against the model on the CPU at DP=2 + EP
    # (benchmarks/RESULTS.md). Not used at DP = 1.
    epoch_gate_fill: float = 0.8
    epoch_gate_rounds: int = 96

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ainfer_pd.mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.p_lane_min_tokens is not None and self.p_lane_min_tokens < 2:
            # The lane computes num_tokens - 1 tokens; fewer than 2 would leave nothing to do.
            raise ConfigError(
                f"ainfer_pd.p_lane_min_tokens={self.p_lane_min_tokens!r} must be >= 2"
            )
        if self.max_p_inflight < 1:
            raise ConfigError(f"ainfer_pd.max_p_inflight={self.max_p_inflight!r} must be >= 1")
        for name, choices in (
            ("ordering", ORDERINGS),
            ("segment_policy", SEGMENT_POLICIES),
            ("rendezvous", RENDEZVOUS),
            ("p_host", P_HOSTS),
            ("d_stream_priority", D_STREAM_PRIORITIES),
            ("p_stream_marks", P_STREAM_MARKS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"ainfer_pd.{name}={value!r} is not one of {', '.join(choices)}")
        if self.segment_span < 1:
            raise ConfigError(f"ainfer_pd.segment_span={self.segment_span!r} must be >= 1")
        if self.segment_span != 1 and self.segment_policy != "fixed":
            # Ignoring it would run another K than the one asked for.
            raise ConfigError(
                f"ainfer_pd.segment_span={self.segment_span!r} applies to segment_policy='fixed'; "
                f"segment_policy={self.segment_policy!r} chooses K itself"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"ainfer_pd.timeout_s={self.timeout_s!r} must be > 0")
        if not 0.0 <= self.epoch_gate_fill <= 1.0:
            raise ConfigError(f"ainfer_pd.epoch_gate_fill={self.epoch_gate_fill!r} must be in "
                              f"[0, 1] (a fraction of DP size x max_num_batched_tokens)")
        if self.epoch_gate_rounds < 1:
            raise ConfigError(f"ainfer_pd.epoch_gate_rounds={self.epoch_gate_rounds!r} must be "
                              f">= 1 (D iterations the oldest queued lane work may wait)")
        if self.p_sm_count < 0:
            raise ConfigError(f"ainfer_pd.p_sm_count={self.p_sm_count!r} must be >= 0 (0: P may "
                              f"take every SM)")
        if self.p_deepep_sms < 2 or self.p_deepep_sms % 2:
            raise ConfigError(f"ainfer_pd.p_deepep_sms={self.p_deepep_sms!r} must be a positive "
                              f"even number (DeepEP runs one channel per two SMs)")

    def lane_min_tokens(self, dp_size: int) -> int:
        """The lane's threshold in uncached tokens: `p_lane_min_tokens` where set, else by
        layout. At DP = 1, 512: a shorter prompt rides in D's step and delays only its own
        replica, less than a lane epoch would delay its first token. At DP > 1, every prompt (2,
        the least the lane computes): an inline prefill stretches the step of every DP rank,
        which is what the lane removes, and with the epoch gate the scale model projects 2-4%
        shorter rollouts than at 512 (docs/scale-model.md, projected)."""
        if self.p_lane_min_tokens is not None:
            return self.p_lane_min_tokens
        return 512 if dp_size == 1 else 2

    @property
    def p_lane_enabled(self) -> bool:
        """`mode="normal"` has no P lane at all."""
        return self.mode == "pd"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> AInferPDConfig:
        raw = dict(raw or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown ainfer_pd option(s) {', '.join(map(repr, unknown))}; "
                f"known options: {', '.join(known)}"
            )
        for name, value in raw.items():
            default = known[name].default
            if value is None and default is None:
                continue  # an option that is unset by default may be unset explicitly
            expected = int if default is None else type(default)  # `int | None` fields
            if expected is float and type(value) is int:
                value = raw[name] = float(value)
            if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
                raise ConfigError(
                    f"ainfer_pd.{name}={value!r} must be of type {expected.__name__}"
                )
        return cls(**raw)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> AInferPDConfig:
        additional = vllm_config.additional_config or {}
        return cls.from_dict(additional.get(CONFIG_KEY))
