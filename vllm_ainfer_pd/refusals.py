"""Settings that would be silently ignored are refused with one line instead.

vLLM passes `additional_config` through to every backend without reading it, so
`additional_config={"ainfer_pd": {...}}` with another executor backend (`mp`, `uni`, `ray`, or
`external_launcher` as TRL's colocate mode uses) would run stock vLLM while the user believes the
P lane is on. `refuse_options_without_backend` runs where vLLM resolves the executor class for
every backend (`vllm_glue/executor_class.py`): vLLM does that while it builds the `VllmConfig`, so
the error comes before any engine process starts.
"""

from __future__ import annotations

from vllm_ainfer_pd import BACKEND_NAME
from vllm_ainfer_pd.config import CONFIG_KEY, ConfigError

# The executor's class, by name: the backend may also be given as its class or class path.
EXECUTOR = ("vllm_ainfer_pd", "AInferPDExecutor")


def refuse_options_without_backend(vllm_config) -> None:
    """Raise `ConfigError` if `additional_config` holds ainfer_pd options while the executor
    backend is not this plugin's (its name, its executor class, or that class's path)."""
    options = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    backend = vllm_config.parallel_config.distributed_executor_backend
    if options is None or not _another_backend(backend):
        return
    name = backend if isinstance(backend, str) else f"{backend.__module__}.{backend.__qualname__}"
    raise ConfigError(
        f"additional_config[{CONFIG_KEY!r}] is set but distributed_executor_backend={name!r} "
        f"ignores it: the ainfer_pd options need distributed_executor_backend={BACKEND_NAME!r} "
        f"(--distributed-executor-backend {BACKEND_NAME}), or remove them")


def _another_backend(backend) -> bool:
    """True where `backend` is surely not this plugin's executor. A class path that does not
    import is left to vLLM, whose own error names it on the next line it runs."""
    if backend == BACKEND_NAME:
        return False
    if isinstance(backend, str):
        if "." not in backend:  # one of vLLM's own names
            return True
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            backend = resolve_obj_by_qualname(backend)
        except (ImportError, AttributeError, ValueError):
            return False
    return not (isinstance(backend, type) and any(
        cls.__module__.split(".")[0] == EXECUTOR[0] and cls.__name__ == EXECUTOR[1]
        for cls in backend.__mro__))
