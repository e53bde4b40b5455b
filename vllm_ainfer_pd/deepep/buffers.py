"""DeepEP buffers per phase: a normal-mode buffer for P, the low-latency buffer for D.

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

P's SM count (`p_deepep_sms`) travels in P's own dispatch and combine configs (`p_configs`),
which P's kernels pass to every call. DeepEP's recommended configs read a class-wide setting,
`Buffer.num_sms`, that anything in the process may set (vLLM's high-throughput manager does, for
dual-batch overlap) and that a call without a config falls back to: P's configs are made once,
with that setting held at P's count only while DeepEP builds them, so no later change reaches P.
D's low-latency kernels take no SM count.

The DeepEP this code and vLLM 0.26 call: `check_api` compares the installed `deep_ep.Buffer`
with the parameters vLLM's managers and kernels and the lane pass, when the backend is selected.

Within a host the two coexist: the normal-mode buffer uses CUDA IPC only, the low-latency one
NVSHMEM. Across hosts they cannot in DeepEP's 1.x buffer (docs/deepep.md): a normal-mode
internode buffer initialises NVSHMEM over the RDMA ranks, a low-latency one over all ranks, and a
process has one NVSHMEM world; both would also take the same QPs per peer. `PhaseBuffers`
refuses EP > 8.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The DeepEP scripts/build_deepep.sh builds by default: the last 1.x commit, which has the
# `enable_shrink` vLLM 0.26 passes and builds against torch 2.11's NCCL. vLLM 0.26's own pin
# (tools/ep_kernels/install_python_libraries.sh) has the same `Buffer` but needs NCCL >= 2.30.4.
DEEPEP_DEFAULT = "29d31c0"
DEEPEP_VLLM_PIN = "d4f41e4e93"
BUILD_HINT = (f"DEEPEP_SRC=/path/to/DeepEP bash scripts/build_deepep.sh (DeepEP commit "
              f"{DEEPEP_DEFAULT}, built for this torch; or vLLM 0.26's pin {DEEPEP_VLLM_PIN} "
              f"with NCCL >= 2.30.4)")
NUM_MAX_NVL_PEERS = 8  # DeepEP's ranks per NVLink domain; more ranks are internode
MIB = 1 << 20

_LL_MANAGER = "vLLM 0.26's deepep_low_latency manager (DeepEPLLAll2AllManager)"
_HT_MANAGER = "vLLM 0.26's deepep_high_throughput manager and the lane's normal-mode buffer"
_LL_KERNELS = "vLLM 0.26's low-latency prepare/finalize (D's kernels)"
_HT_KERNELS = "vLLM 0.26's high-throughput prepare/finalize (P's kernels)"
# What vLLM 0.26 and the lane call on `deep_ep.Buffer`: (method, parameters passed by name, who
# passes them). Read from vLLM's device_communicators/all2all.py (the managers' buffer kwargs)
# and fused_moe/prepare_finalize/deepep_{ll,ht}.py (the kernels' calls).
BUFFER_API: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("__init__", ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
                  "num_qps_per_rank", "explicitly_destroy"), _HT_MANAGER),
    ("__init__", ("allow_nvlink_for_low_latency_mode", "allow_mnnvl", "enable_shrink"),
     _LL_MANAGER),
    ("low_latency_dispatch", ("use_fp8", "round_scale", "use_ue8m0", "async_finish",
                              "return_recv_hook"), _LL_KERNELS),
    ("low_latency_combine", ("zero_copy", "async_finish", "return_recv_hook", "out"),
     _LL_KERNELS),
    ("get_dispatch_layout", ("topk_idx", "num_experts", "previous_event", "async_finish",
                             "allocate_on_comm_stream"), _HT_KERNELS),
    ("dispatch", ("x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                  "is_token_in_rank", "num_tokens_per_expert", "topk_idx", "topk_weights",
                  "expert_alignment", "config", "previous_event", "async_finish",
                  "allocate_on_comm_stream"), _HT_KERNELS),
    ("combine", ("x", "handle", "topk_weights", "config", "previous_event", "async_finish",
                 "allocate_on_comm_stream"), _HT_KERNELS),
    ("get_low_latency_rdma_size_hint", ("num_max_dispatch_tokens_per_rank", "hidden",
                                        "num_ranks", "num_experts"), _LL_MANAGER),
    ("get_dispatch_config", (), "the lane's sizing"),  # called positionally
    ("get_combine_config", (), "the lane's sizing"),
    ("set_num_sms", (), "the lane's sizing"),
    ("capture", (), _HT_KERNELS),
    ("destroy", (), "vLLM's managers and the lane"),
)
MODULE_API = ("Buffer", "Config", "EventOverlap")  # deep_ep.<name>, read by vLLM and the lane


class DeepEPUnavailable(RuntimeError):
    """The phase-owned DeepEP pair cannot run here (one line: what to install or change)."""


def check_installed() -> None:
    """When the backend is selected, before any engine process builds a buffer: `deep_ep` is
    installed, imports, and has what vLLM 0.26 and the lane call (`check_api`)."""
    if importlib.util.find_spec("deep_ep") is None:
        raise DeepEPUnavailable(f"ainfer_pd mode='pd' with a DeepEP all2all backend builds "
                                f"phase-owned DeepEP buffers, but the deep_ep package is not "
                                f"installed; build it with {BUILD_HINT}")
    check_api(import_deep_ep())


def import_deep_ep() -> Any:
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - e.g. built against another torch, NVSHMEM, NCCL
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        raise DeepEPUnavailable(f"import deep_ep failed ({detail}); rebuild it with "
                                f"{BUILD_HINT}") from None
    return deep_ep


def check_api(deep_ep: Any) -> None:
    """Raise `DeepEPUnavailable` (one line: what is missing, who passes it, what to build) unless
    `deep_ep` has every name and `Buffer` parameter vLLM 0.26's DeepEP managers and kernels and
    the lane pass. DeepEP v1.2.1, for one, has no `enable_shrink`."""
    where = f"deep_ep at {getattr(deep_ep, '__file__', '?')} (DeepEP {_version(deep_ep)})"
    for name in MODULE_API:
        if not hasattr(deep_ep, name):
            raise DeepEPUnavailable(f"{where} has no deep_ep.{name}, which vLLM 0.26 and the lane "
                                    f"use; build {BUILD_HINT}")
    for owner, name in ((deep_ep.Buffer, "num_sms"), (deep_ep.Config, "get_nvl_buffer_size_hint")):
        if not hasattr(owner, name):
            raise DeepEPUnavailable(f"{where} has no {owner.__name__}.{name}, which the lane's "
                                    f"sizing reads; build {BUILD_HINT}")
    for method, params, caller in BUFFER_API:
        function = getattr(deep_ep.Buffer, method, None)
        if function is None:
            raise DeepEPUnavailable(f"{where} has no Buffer.{method}, which {caller} calls; "
                                    f"build {BUILD_HINT}")
        missing = [p for p in params if not _accepts(function, p)]
        if missing:
            raise DeepEPUnavailable(f"{where} has no parameter {', '.join(missing)} in "
                                    f"Buffer.{method}, which {caller} passes; build {BUILD_HINT}")


def _accepts(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a compiled function without a signature: not checked
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                     for p in parameters.values())


def _version(deep_ep: Any) -> str:
    version = getattr(deep_ep, "__version__", None)
    if version is None:
        try:
            import importlib.metadata

            version = importlib.metadata.version("deep_ep")
        except Exception:  # noqa: BLE001 - a version is only part of the message
            version = "?"
    return str(version)


def p_configs(deep_ep: Any, ep_size: int, p_sms: int) -> tuple[Any, Any]:
    """DeepEP's recommended normal-mode dispatch and combine configs for `ep_size` ranks, on
    P's `p_sms` SMs. DeepEP builds them from the class-wide `Buffer.num_sms`, which is set to
    P's count for this call only and put back."""
    buffer = deep_ep.Buffer
    saved = buffer.num_sms
    try:
        buffer.set_num_sms(p_sms)
        return buffer.get_dispatch_config(ep_size), buffer.get_combine_config(ep_size)
    except AssertionError:
        raise DeepEPUnavailable(f"DeepEP's normal mode has no config for EP={ep_size} (it runs "
                                f"2, 4 or 8 ranks within a host)") from None
    finally:
        buffer.num_sms = saved


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
                f"which DeepEP's 1.x buffer cannot hold in one process (one NVSHMEM world, shared "
                f"QPs: docs/deepep.md); use mode='normal'")
        configs = p_configs(deep_ep, ep_size, p_sms)
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
    normal-mode buffer is replaced on every rank at one agreed point (`rebuild`; `PhaseEP` keeps
    the retirement and refuses P's next epoch until then); the low-latency buffer is D's for the
    life of the process.

    `dispatch_config` / `combine_config` carry P's SM count; P's kernels pass them to every call
    (`configs`: explicit ones, e.g. for an EP size DeepEP recommends none for; default
    `p_configs` for the sizes' EP size and P's SMs).
    """

    def __init__(self, deep_ep: Any, group: Any, sizes: DeepEPSizes, d_buffer: Any,
                 configs: tuple[Any, Any] | None = None) -> None:
        self.deep_ep = deep_ep
        self.group = group  # the EP group's CPU (gloo) process group
        self.sizes = sizes
        self.dispatch_config, self.combine_config = (
            configs if configs is not None else p_configs(deep_ep, sizes.ep_size, sizes.p_sms))
        self.low_latency = d_buffer
        if d_buffer is not None and not d_buffer.low_latency_mode:
            raise DeepEPUnavailable("D's DeepEP buffer is not in low-latency mode: vLLM must "
                                    "build D with --all2all-backend deepep_low_latency")
        self.normal = self._new_normal()
        self.rebuilds = 0

    def _new_normal(self) -> Any:
        # Collective over the EP group: DeepEP all-gathers device ids and IPC handles.
        return self.deep_ep.Buffer(self.group, num_nvl_bytes=self.sizes.p_nvl_bytes,
                                   num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                                   explicitly_destroy=True)

    def for_p(self) -> Any:
        buffer = self.normal
        check_normal(buffer, self.low_latency)
        return buffer

    def rebuild(self) -> None:
        """Collective over the EP group, once P's submitted device work drained: DeepEP's
        `destroy` synchronises the device and meets its peers in an NVLink barrier."""
        self.normal.destroy()
        self.normal = self._new_normal()
        self.rebuilds += 1

    def destroy(self) -> None:
        if self.normal is not None:
            self.normal.destroy()
            self.normal = None


def check_normal(buffer: Any, low_latency: Any) -> None:
    """A normal-mode call must never reach the low-latency buffer."""
    if buffer is low_latency or buffer.low_latency_mode:
        raise AssertionError("a DeepEP normal-mode call reached the low-latency buffer (D's)")
