"""The per-rank vLLM worker behind the `ainfer_pd` backend.

The base class is the platform's own worker (CPUWorker on CPU, the V1 GPU Worker on CUDA), chosen
when this module is imported in the worker process, so the same class name serves both platforms.
This is where the turnstile, the background P thread and the decoder-layer boundary hooks attach.
"""

from __future__ import annotations

from vllm.platforms import current_platform


def _platform_worker_cls() -> type:
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class AInferPDWorker(_platform_worker_cls()):
    def ainfer_pd_status(self) -> dict:
        """Per-rank status over `collective_rpc("ainfer_pd_status")`: which worker and mode run."""
        from vllm_ainfer_pd.config import AInferPDConfig

        return {
            "worker": type(self).__name__,
            "rank": self.rank,
            "mode": AInferPDConfig.from_vllm_config(self.vllm_config).mode,
        }

    def init_device(self) -> None:
        if current_platform.is_cpu():
            # Expert parallelism on CPU needs what vLLM 0.26's CPU path lacks (see cpu_compat);
            # installed before the model and its communicators are built.
            from vllm_ainfer_pd.worker import cpu_compat

            cpu_compat.install()
        super().init_device()
