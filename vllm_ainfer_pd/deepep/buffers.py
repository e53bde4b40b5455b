"""DeepEP (v1.2.1) buffers per phase: a normal-mode buffer for P, the low-latency buffer for D.

DeepEP's normal (high-throughput) and low-latency modes were built as alternatives: one
`deep_ep.Buffer` holds the NVLink ring buffers, the RDMA buffer, the receive counters the CPU
polls, the workspace and the communication stream that both modes' kernels advance. P's normal
dispatch beside D's low-latency one on a shared buffer would advance each other's state. So each
phase has its own `Buffer`, created once per process:

- D: the low-latency buffer vLLM builds for `--all2all-backend deepep_low_latency` (its
  `DeepEPLLAll2AllManager`, sized by vLLM for its step budget), captured in D's CUDA graphs;
- P: a normal-mode buffer of its own over the same EP ranks: NVLink bytes only within a host,
  sized from the hidden size, P's SM count (DeepEP runs one channel per two SMs, and its NVLink
  ring holds a fixed number of chunked tokens per channel and peer) and the EP size.

P's SM count (`p_deepep_sms`) is DeepEP's process-wide normal-mode setting (`Buffer.num_sms`,
read by its recommended configs); only P runs normal mode, and D's low-latency kernels do not
read it.

Within a host the two coexist: the normal-mode buffer uses CUDA IPC only, the low-latency one
NVSHMEM. Across hosts they cannot in v1.2.1 (docs/deepep.md): a normal-mode internode buffer
initialises NVSHMEM over the RDMA ranks, a low-latency one over all ranks, and a process has one
NVSHMEM world; both would also take the same QPs per peer. `PhaseBuffers` refuses EP > 8.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

BUILD_HINT = ("DEEPEP_SRC=/path/to/DeepEP bash scripts/build_deepep.sh (DeepEP v1.2.1 built for "
              "this torch, with NVSHMEM from pip nvidia-nvshmem-cu13)")
NUM_MAX_NVL_PEERS = 8  # DeepEP's ranks per NVLink domain; more ranks are internode
MIB = 1 << 20


class DeepEPUnavailable(RuntimeError):
    """The phase-owned DeepEP pair cannot run here (one line: what to install or change)."""


def check_installed() -> None:
    """At selection time, without importing it (the frontend may have no GPU): is `deep_ep`
    importable at all?"""
    if importlib.util.find_spec("deep_ep") is None:
        raise DeepEPUnavailable(f"ainfer_pd mode='pd' with a DeepEP all2all backend builds "
                                f"phase-owned DeepEP buffers, but the deep_ep package is not "
                                f"installed; build it with {BUILD_HINT}")


def import_deep_ep() -> Any:
    try:
        import deep_ep
    except ImportError as exc:  # e.g. built against another torch or NVSHMEM
        raise DeepEPUnavailable(f"import deep_ep failed ({exc}); rebuild it with "
                                f"{BUILD_HINT}") from None
    return deep_ep


@dataclass(frozen=True)
class DeepEPSizes:
    """What each phase's buffer holds per rank, and P's SM count. Bytes are per rank."""

    ep_size: int
    hidden: int
    num_experts: int
    top_k: int
    p_sms: int
    p_max_tokens: int  # P's largest epoch (tokens per rank)
    d_max_tokens: int  # D's low-latency dispatch capacity (tokens per rank)
    p_nvl_bytes: int
    d_rdma_bytes: int
    d_nvl_bytes: int
    # P's receive tensors for one dispatch of its largest epoch (allocated per call on P's
    # stream by PyTorch's allocator, freed after the combine): every rank's tokens, each with
    # its top-k ids and weights.
    p_recv_bytes: int

    @classmethod
    def compute(cls, deep_ep: Any, *, ep_size: int, hidden: int, num_experts: int, top_k: int,
                p_sms: int, p_max_tokens: int, d_max_tokens: int,
                d_nvl_bytes: int = 0) -> DeepEPSizes:
        """With DeepEP's own sizing helpers: the NVLink ring of P's normal-mode dispatch and
        combine configs (`get_dispatch_config` / `get_combine_config` for the EP size, P's SMs)
        and the low-latency RDMA layout for D's capacity (`get_low_latency_rdma_size_hint`)."""
        if ep_size > NUM_MAX_NVL_PEERS:
            raise DeepEPUnavailable(
                f"phase-owned DeepEP runs within one NVLink domain (EP <= {NUM_MAX_NVL_PEERS}); "
                f"EP={ep_size} needs a normal-mode internode buffer beside the low-latency one, "
                f"which DeepEP v1.2.1 cannot hold in one process (one NVSHMEM world, shared "
                f"QPs: docs/deepep.md); use mode='normal'")
        deep_ep.Buffer.set_num_sms(p_sms)  # DeepEP's recommended configs read it
        try:
            configs = (deep_ep.Buffer.get_dispatch_config(ep_size),
                       deep_ep.Buffer.get_combine_config(ep_size))
        except AssertionError:
            raise DeepEPUnavailable(f"DeepEP v1.2.1's normal mode has no config for EP={ep_size} "
                                    f"(it runs 2, 4 or 8 ranks within a host)") from None
        hidden_bytes = hidden * 2  # bf16, the widest dispatch format
        p_nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ep_size) for c in configs)
        d_rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(d_max_tokens, hidden, ep_size,
                                                               num_experts)
        p_recv = ep_size * p_max_tokens * (hidden_bytes + top_k * (8 + 4))
        return cls(ep_size, hidden, num_experts, top_k, p_sms, p_max_tokens, d_max_tokens,
                   p_nvl, d_rdma, d_nvl_bytes, p_recv)

    def describe(self) -> str:
        return (f"phase-owned DeepEP, EP={self.ep_size}, hidden {self.hidden}, "
                f"{self.num_experts} experts, top-{self.top_k}: P normal mode on {self.p_sms} SMs, "
                f"NVLink buffer {self.p_nvl_bytes / MIB:.1f} MiB per rank (+ up to "
                f"{self.p_recv_bytes / MIB:.1f} MiB of receive tensors per dispatch of a "
                f"{self.p_max_tokens}-token epoch); D low latency for {self.d_max_tokens} tokens "
                f"per rank, RDMA buffer {self.d_rdma_bytes / MIB:.1f} MiB (+ NVLink "
                f"{self.d_nvl_bytes / MIB:.1f} MiB) per rank; both buffers "
                f"{(self.p_nvl_bytes + self.d_rdma_bytes + self.d_nvl_bytes) / MIB:.1f} MiB")


class PhaseBuffers:
    """P's normal-mode buffer and D's low-latency buffer of one process.

    `for_p()` is the only way P's kernels reach a buffer: it checks that the buffer is the
    normal-mode one, never D's (a normal-mode call on the low-latency buffer would advance the
    state D's captured graphs replay against). After a failed P epoch that dispatched, the
    normal-mode buffer is retired (`retire`) and replaced on every rank at one agreed point
    (`rebuild`); the low-latency buffer is D's for the life of the process.
    """

    def __init__(self, deep_ep: Any, group: Any, sizes: DeepEPSizes, d_buffer: Any) -> None:
        self.deep_ep = deep_ep
        self.group = group  # the EP group's CPU (gloo) process group
        self.sizes = sizes
        self.low_latency = d_buffer
        if d_buffer is not None and not d_buffer.low_latency_mode:
            raise DeepEPUnavailable("D's DeepEP buffer is not in low-latency mode: vLLM must "
                                    "build D with --all2all-backend deepep_low_latency")
        self.normal = self._new_normal()
        self.retired = False
        self.rebuilds = 0

    def _new_normal(self) -> Any:
        # Collective over the EP group: DeepEP all-gathers device ids and IPC handles.
        return self.deep_ep.Buffer(self.group, num_nvl_bytes=self.sizes.p_nvl_bytes,
                                   num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                                   explicitly_destroy=True)

    def for_p(self) -> Any:
        buffer = self.normal
        if self.retired:
            raise RuntimeError("P's DeepEP normal-mode buffer is retired (a failed epoch left it "
                               "half-advanced) and not yet rebuilt")
        check_normal(buffer, self.low_latency)
        return buffer

    def retire(self) -> None:
        self.retired = True

    def rebuild(self, drain: Callable[[], None] | None = None) -> None:
        """Collective over the EP group. `drain` waits for P's submitted device work; DeepEP's
        `destroy` then synchronises the device and meets its peers in an NVLink barrier."""
        if drain is not None:
            drain()
        self.normal.destroy()
        self.normal = self._new_normal()
        self.retired = False
        self.rebuilds += 1

    def destroy(self) -> None:
        if self.normal is not None:
            self.normal.destroy()
            self.normal = None


def check_normal(buffer: Any, low_latency: Any) -> None:
    """A normal-mode call must never reach the low-latency buffer."""
    if buffer is low_latency or buffer.low_latency_mode:
        raise AssertionError("a DeepEP normal-mode call reached the low-latency buffer (D's)")
