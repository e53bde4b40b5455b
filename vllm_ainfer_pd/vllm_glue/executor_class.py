"""The backend's short name: `Executor.get_class` resolves `ainfer_pd` to our executor.

vLLM resolves `--distributed-executor-backend` through the static method `Executor.get_class`
(a dot-less string other than its own names would fail in `resolve_obj_by_qualname`). Every
call site looks it up on the class, so one wrap, applied by the plugin in every vLLM process
before any `VllmConfig` is built, is enough.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_ainfer_pd.refusals import refuse_options_without_backend
from vllm_ainfer_pd.vllm_glue.shapes import Patch

PATCHES = [
    Patch("vllm.v1.executor.abstract:Executor.get_class", "`--distributed-executor-backend "
          "ainfer_pd` (a name without dots) resolves to AInferPDExecutor, validated and with the "
          "P lane configured", ("vllm_config",), does="wraps"),
    Patch("vllm.v1.executor.multiproc_executor:MultiprocExecutor._init_executor",
          "AInferPDExecutor chooses its worker and scheduler classes there, before EngineCore "
          "builds the scheduler and the workers start", ("self",), does="overrides"),
    Patch("vllm.v1.executor.abstract:Executor.supports_pp", "vLLM refuses pipeline "
          "parallelism for an executor that does not support it (ours sets it False)",
          does="sets"),
]


def installed() -> bool:
    """Whether this process resolves the backend's short name (the plugin ran here)."""
    from vllm.v1.executor.abstract import Executor

    return getattr(Executor.get_class, "_ainfer_pd", False)


def install(name: str, select: Callable[[object], type]) -> None:
    """Make `Executor.get_class(vllm_config)` return `select(vllm_config)` when the backend is
    `name`; other backends resolve as before. Idempotent."""
    from vllm.v1.executor.abstract import Executor

    if installed():
        return
    stock_get_class = Executor.get_class

    def get_class(vllm_config):
        if vllm_config.parallel_config.distributed_executor_backend == name:
            return select(vllm_config)
        refuse_options_without_backend(vllm_config)  # ainfer_pd options would be ignored here
        return stock_get_class(vllm_config)

    get_class._ainfer_pd = True
    Executor.get_class = staticmethod(get_class)
