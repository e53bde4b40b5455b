"""vLLM general plugin: makes `--distributed-executor-backend ainfer_pd` resolve to our executor.

vLLM loads `vllm.general_plugins` entry points once in every process it starts (API server, engine
cores, workers) before any `VllmConfig` is built, and resolves the backend string through
`Executor.get_class`, which `vllm_glue/executor_class.py` wraps. The fully qualified form
`vllm_ainfer_pd.executor.AInferPDExecutor` needs no plugin and is checked the same way.
"""

from __future__ import annotations

import logging

from vllm_ainfer_pd import BACKEND_NAME

logger = logging.getLogger(__name__)


class _ThroughVllm(logging.Handler):
    """Hands each record to vLLM's logger as it is when the record is made. vLLM 0.26 sets up its
    handlers when `vllm.logger` is imported; 0.32 only when an engine or the CLI applies its
    logging config, which in some processes comes after plugins load, so copying its handlers at
    registration would find none there."""

    def emit(self, record: logging.LogRecord) -> None:
        # vLLM's handlers filter by their own level; with vLLM's logging turned off the record
        # propagates to the root (Python's last resort prints warnings and errors).
        logging.getLogger("vllm").handle(record)


def log_through_vllm() -> None:
    """Send this package's log records to vLLM's handlers, at vLLM's level, so the lane's messages
    (stream priorities, the periodic lane summary, failed epochs) appear in `vllm serve` output in
    vLLM's format, or wherever VLLM_LOGGING_CONFIG_PATH sends them. Without it the package logger
    has no handler and Python's last-resort handler drops everything below WARNING."""
    import vllm.envs

    ours = logging.getLogger("vllm_ainfer_pd")
    if any(isinstance(h, _ThroughVllm) for h in ours.handlers):
        return
    ours.addHandler(_ThroughVllm())
    ours.setLevel(logging.getLogger("vllm").level or vllm.envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False  # vLLM's logger passes it on; the root's handlers would print twice


def register() -> None:
    """Entry point. Idempotent and cheap: it runs in every vLLM process, the API server too."""
    from vllm_ainfer_pd.connector import register_connector
    from vllm_ainfer_pd.vllm_glue import executor_class

    log_through_vllm()
    register_connector()  # the P lane's KV connector, resolved by name in every process
    executor_class.install(BACKEND_NAME, _select_executor)


def registration_problem() -> str | None:
    """Why vLLM would not load this plugin in a process started like this one, or None.

    vLLM finds general plugins through the `vllm.general_plugins` entry points of the installed
    distributions (`VLLM_PLUGINS`, if set, must name `ainfer_pd`). Without the plugin, vLLM
    resolves `ainfer_pd` as a class path, and building the engine config fails inside
    `VllmConfig` with a pydantic `ValidationError: ... not enough values to unpack (expected 2,
    got 1)` (`resolve_obj_by_qualname` splits the name at its last dot). That happens when the
    package is importable but not installed (on `PYTHONPATH` only)."""
    import os
    from importlib.metadata import entry_points

    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and BACKEND_NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves out {BACKEND_NAME!r}"
    points = [e for e in entry_points(group="vllm.general_plugins") if e.name == BACKEND_NAME]
    if not points:
        return (f"no vllm.general_plugins entry point named {BACKEND_NAME!r}: the package is "
                f"importable but not installed (pip install -e . in the checkout)")
    return None


def _select_executor(vllm_config) -> type:
    """`ainfer_pd`'s executor class, once the config is validated and the P lane configured."""
    from vllm_ainfer_pd.executor import AInferPDExecutor, configure_p_lane

    configure_p_lane(vllm_config, AInferPDExecutor.validate(vllm_config))
    return AInferPDExecutor
