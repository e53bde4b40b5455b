"""Phase routing in vLLM's MoE layers: P's calls resolve to P's own expert-parallel state.

Two seams, both selected by the calling thread: the P thread (whose marker, the worker's
`phase_state._P`, is active between `enter_p` and `leave_p`: `set_marker`) or any other thread,
which is D.

1. The group getters. vLLM's MoE path finds its communicators at call time: the MoE runner's and
   the naive prepare/finalize's `get_ep_group().dispatch(...)`, the all-gather/reduce-scatter
   manager's `get_dp_group().all_gatherv(...)`. 36 vLLM modules import `get_ep_group` by value
   (17 `get_dp_group`), so patching the module attribute would miss them; as `phase_state` does
   for the forward context, the code objects of the two getters are replaced, once per process,
   by versions that first ask whether the calling thread is P and P has its own group of that
   kind (`deepep.phase_groups.PhaseGroups`). D's threads see vLLM's groups exactly as before.
   This is the whole of phase routing for the stateless `allgather_reducescatter` backend: its
   prepare/finalize and its experts keep no state, so one kernel per layer serves both phases.

2. The fused-MoE kernel (for stateful backends, DeepEP): each layer's quant method holds one
   `FusedMoEKernel` (`quant_method.moe_kernel`), whose every method goes through its `impl`
   (prepare/finalize + experts). `PhaseMoEKernel` holds D's kernel and P's over the same weights
   and answers `impl` with the calling thread's, so D's CUDA graphs capture D's (low-latency)
   path and P runs its own (normal mode) eagerly. The MoE runner reaches the kernel inside
   vLLM's `moe_forward` custom op, outside the compiled graph, so the choice is made per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch, vllm_at_least

_MOE = "vllm.model_executor.layers.fused_moe"
PATCHES = [
    Patch("vllm.distributed.parallel_state:get_ep_group", "on the P thread, return P's own EP "
          "group (P's MoE dispatch and combine)", (), does="replaces the code of"),
    Patch("vllm.distributed.parallel_state:get_dp_group", "on the P thread, return P's own DP "
          "group (the all-gather/reduce-scatter manager's collectives)", (),
          does="replaces the code of"),
    Patch("vllm.distributed.parallel_state:_EP", "the global the replaced code reads for D",
          does="reads"),
    Patch("vllm.distributed.parallel_state:_DP", "the global the replaced code reads for D",
          does="reads"),
    Patch("vllm.distributed.parallel_state:init_model_parallel_group", "P's own EP and DP "
          "groups, over vLLM's partition of the world",
          uses=("group_ranks", "local_rank", "backend", "group_name"), does="calls"),
    Patch("vllm.distributed.parallel_state:init_model_parallel_group", "P's EP group gets an "
          "all-to-all manager where vLLM's has one (0.32 asks for it by this flag)",
          uses=("use_all2all",), does="calls", vllm=">=0.32"),
    Patch("vllm.distributed.device_communicators.base_device_communicator:"
          "DeviceCommunicatorBase", "whether vLLM's group has an all-to-all manager",
          uses=("use_all2all",), does="reads", vllm=">=0.32"),
    Patch("vllm.distributed.parallel_state:GroupCoordinator", "P's groups copy vLLM's partition, "
          "backend and device; the route reads their ranks", uses=("group_ranks", "local_rank",
          "torch_distributed_backend", "unique_name", "ranks", "destroy"), does="reads"),
    Patch(f"{_MOE}.modular_kernel:FusedMoEKernel", "PhaseMoEKernel holds D's kernel and P's and "
          "answers `impl` (every method's delegate) with the calling phase's", uses=("impl",),
          does="subclasses", platform="cuda"),
    Patch(f"{_MOE}.fused_moe_method_base:FusedMoEMethodBase", "each MoE layer's kernel is "
          "replaced by a PhaseMoEKernel", uses=("moe_kernel",), does="sets an attribute of",
          platform="cuda"),
    Patch(f"{_MOE}.routed_experts:RoutedExperts", "the MoE layers whose kernels get a P kernel",
          uses=("quant_method",), does="reads", platform="cuda"),
]


_MARKER = threading.local()  # replaced by the caller's P-thread marker at install


def is_p_thread() -> bool:
    """Whether the calling thread is P (its marker's `active` is set: `phase_state.enter_p`)."""
    return getattr(_MARKER, "active", False)


class _PView:
    """What the replaced getters consult: P's own groups, or none (then P uses D's)."""

    phase_groups: Any = None

    def get(self, kind: str) -> Any:
        groups = self.phase_groups
        return None if groups is None else groups.get(kind)


_VIEW = _PView()


# ---- replacement code objects (run with vllm.distributed.parallel_state's globals) -------------
# `_EP`, `_DP` are vLLM's; `_ainfer_pd_p` (the P-thread marker) and `_ainfer_pd_view` are injected
# by `install_group_view`.


def _get_ep_group():  # vllm.distributed.parallel_state.get_ep_group
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        group = _ainfer_pd_view.get("ep")  # noqa: F821
        if group is not None:
            return group
    assert _EP is not None, (  # noqa: F821
        "expert parallel group is not initialized. "
        "EP group is only created for MoE models with num_experts > 0. "
        "This function should only be called for MoE models."
    )
    return _EP  # noqa: F821


def _get_dp_group():  # vllm.distributed.parallel_state.get_dp_group
    if getattr(_ainfer_pd_p, "active", False):  # noqa: F821
        group = _ainfer_pd_view.get("dp")  # noqa: F821
        if group is not None:
            return group
    assert _DP is not None, "data parallel group is not initialized"  # noqa: F821
    return _DP  # noqa: F821


_installed = threading.Lock()


def set_marker(marker: Any) -> None:
    """The thread-local whose `active` attribute is set on the P thread (the worker's
    `phase_state._P`). Call once per process, before `install_group_view` and
    `install_phase_kernels`."""
    global _MARKER
    _MARKER = marker


def install_group_view(phase_groups: Any) -> None:
    """From here on, the P thread's `get_ep_group()` / `get_dp_group()` return `phase_groups`'
    (read at every call, so a rebuild is seen at once). Idempotent; `None` detaches P's groups."""
    from vllm.distributed import parallel_state

    with _installed:
        _VIEW.phase_groups = phase_groups
        parallel_state._ainfer_pd_p = _MARKER
        if getattr(parallel_state, "_ainfer_pd_view", None) is _VIEW:
            return
        parallel_state._ainfer_pd_view = _VIEW
        parallel_state.get_ep_group.__code__ = _get_ep_group.__code__
        parallel_state.get_dp_group.__code__ = _get_dp_group.__code__


# ---- one fused-MoE kernel per phase ------------------------------------------------------------


def phase_kernel_cls() -> type:
    """`PhaseMoEKernel`, defined on first use (vLLM's MoE modules import CUDA-only code)."""
    global _PhaseMoEKernel
    if _PhaseMoEKernel is None:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

        class PhaseMoEKernel(FusedMoEKernel):
            """D's kernel and P's over the same weights; `impl` is the calling thread's. Every
            `FusedMoEKernel` method reads `self.impl`, so `apply`, `prepare_finalize`,
            `output_is_reduced`, ... all answer for the caller's phase."""

            def __init__(self, d_kernel: Any, p_kernel: Any) -> None:
                # No FusedMoEKernel.__init__: both kernels are built and set up already.
                self.d_kernel = d_kernel
                self.p_kernel = p_kernel

            @property
            def impl(self) -> Any:
                return (self.p_kernel if is_p_thread() else self.d_kernel).impl

        _PhaseMoEKernel = PhaseMoEKernel
    return _PhaseMoEKernel


_PhaseMoEKernel: type | None = None


def moe_quant_methods(model: Any) -> list[tuple[str, Any]]:
    """(layer name, quant method) of every routed-experts module of `model` with a kernel."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return [(name, m.quant_method) for name, m in model.named_modules()
            if isinstance(m, RoutedExperts) and m.quant_method.moe_kernel is not None]


def install_phase_kernels(model: Any, make_p_kernel: Callable[[str, Any], Any]) -> int:
    """Give every MoE layer of `model` a P kernel beside its D kernel: `make_p_kernel(layer name,
    D's kernel)` builds P's over the same weights. Returns the number of layers. Run once, after
    vLLM built its kernels and before D's CUDA graphs are captured (they bind D's kernel)."""
    cls = phase_kernel_cls()
    layers = moe_quant_methods(model)
    for name, method in layers:
        d_kernel = method.moe_kernel
        if isinstance(d_kernel, cls):
            continue
        method.moe_kernel = cls(d_kernel, make_p_kernel(name, d_kernel))
    return len(layers)


def copy_group_kwargs(group: Any) -> dict[str, Any]:
    """The keywords `init_model_parallel_group` needs, beyond the partition, backend and name, for
    a copy of vLLM's `group` that dispatches as it does: vLLM 0.32 gives an EP group its
    all-to-all manager only when asked (`use_all2all`), 0.26 always."""
    if not vllm_at_least("0.32"):
        return {}
    communicator = group.device_communicator
    return {"use_all2all": bool(communicator is not None and communicator.use_all2all)}
