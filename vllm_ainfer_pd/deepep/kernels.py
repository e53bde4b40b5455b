"""P's fused-MoE kernel per layer for the phase-owned DeepEP pair.

vLLM builds D's kernel for `deepep_low_latency`: its low-latency prepare/finalize over D's buffer
and a *batched*-format experts kernel (tokens arrive grouped per local expert, padded to the
buffer's capacity). P's kernel is built here over the same weights: vLLM's normal-mode
(high-throughput) prepare/finalize over P's own buffer, and the *standard*-format sibling of D's
experts (tokens arrive as a flat list with their top-k ids), which reads the same weight layout.
`vllm_glue.moe_phase.install_phase_kernels` puts the two side by side in each layer.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from vllm_ainfer_pd.deepep.buffers import DeepEPUnavailable, PhaseBuffers

_EXPERTS = "vllm.model_executor.layers.fused_moe.experts"
# D's batched experts -> the standard-format experts over the same weight layout.
STANDARD_SIBLING = {
    "BatchedTritonExperts": (f"{_EXPERTS}.triton_moe", "TritonExperts"),
    "BatchedDeepGemmExperts": (f"{_EXPERTS}.deep_gemm_moe", "DeepGemmExperts"),
}


def p_experts_for(d_experts: Any) -> Any:
    """A standard-format experts kernel over the same weights as D's batched one."""
    name = type(d_experts).__name__
    if name not in STANDARD_SIBLING:
        raise DeepEPUnavailable(
            f"phase-owned DeepEP runs P's experts in the standard format beside D's batched "
            f"{name}, and knows no standard-format kernel over its weight layout (known: "
            f"{', '.join(STANDARD_SIBLING)}); use mode='normal'")
    module, cls = STANDARD_SIBLING[name]
    moe = d_experts.moe_config
    p_moe = dataclasses.replace(moe, moe_parallel_config=dataclasses.replace(
        moe.moe_parallel_config, all2all_backend="deepep_high_throughput"))
    return getattr(importlib.import_module(module), cls)(p_moe, d_experts.quant_config)


_PNormal: type | None = None


def p_prepare_finalize_cls() -> type:
    """vLLM's normal-mode prepare/finalize, reaching its buffer through `PhaseBuffers.for_p()`
    at every dispatch (the current normal-mode buffer, after a rebuild the new one; never D's),
    passing P's own dispatch and combine configs (P's SM count; vLLM's would read DeepEP's
    class-wide setting at each call), and counting dispatches for the epoch's lifecycle."""
    global _PNormal
    if _PNormal is None:
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
            DeepEPHTPrepareAndFinalize,
        )

        class PNormalPrepareAndFinalize(DeepEPHTPrepareAndFinalize):
            def __init__(self, buffers: PhaseBuffers, on_dispatch: Callable[[], None],
                         **kwargs: Any) -> None:
                super().__init__(buffers.for_p(), **kwargs)
                self.buffers = buffers
                self.on_dispatch = on_dispatch

            def _do_dispatch(self, *args: Any, **kwargs: Any) -> Any:
                self.buffer = self.buffers.for_p()
                self.on_dispatch()
                return super()._do_dispatch(*args, **kwargs)

            def _get_dispatch_config(self) -> Any:
                return self.buffers.dispatch_config

            def _get_combine_config(self) -> Any:
                return self.buffers.combine_config

            def _finalize(self, *args: Any, **kwargs: Any) -> Any:
                # The combine runs on the buffer its dispatch used (its handle lives there).
                if self.buffer is not self.buffers.normal:
                    raise RuntimeError("P's DeepEP combine after its buffer was rebuilt")
                self.buffers.for_p()
                return super()._finalize(*args, **kwargs)

        _PNormal = PNormalPrepareAndFinalize
    return _PNormal


def make_p_kernel_factory(buffers: PhaseBuffers,
                          on_dispatch: Callable[[], None]) -> Callable[[str, Any], Any]:
    """`make_p_kernel(layer name, D's kernel)` for `moe_phase.install_phase_kernels`."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    def make_p_kernel(name: str, d_kernel: Any) -> Any:
        d_pf = d_kernel.prepare_finalize
        if getattr(d_pf, "buffer", None) is not buffers.low_latency:
            raise DeepEPUnavailable(f"MoE layer {name}: D's kernel ({type(d_pf).__name__}) does "
                                    f"not run on D's low-latency buffer")
        moe = d_kernel.fused_experts.moe_config
        parallel = moe.moe_parallel_config
        pf = p_prepare_finalize_cls()(
            buffers, on_dispatch, num_dispatchers=parallel.ep_size, dp_size=parallel.dp_size,
            rank_expert_offset=parallel.ep_rank * moe.num_local_experts)
        return FusedMoEKernel(pf, p_experts_for(d_kernel.fused_experts))

    return make_p_kernel


def d_low_latency_buffer(model: Any) -> Any:
    """D's low-latency buffer: the one vLLM's kernels of `model` were built on (one per
    process, cached by vLLM's all-to-all manager)."""
    from vllm_ainfer_pd.vllm_glue.moe_phase import moe_quant_methods

    buffers = {id(b): b for _, m in moe_quant_methods(model)
               if (b := getattr(m.moe_kernel.prepare_finalize, "buffer", None)) is not None}
    if len(buffers) != 1:
        raise DeepEPUnavailable(f"expected every MoE layer of the model on one DeepEP "
                                f"low-latency buffer, found {len(buffers)}")
    return next(iter(buffers.values()))
