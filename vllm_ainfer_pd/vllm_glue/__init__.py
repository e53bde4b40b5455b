"""Every patch of vLLM internals the backend makes, one module per patched area.

Each module lists in `PATCHES` the vLLM symbols it touches, and the ones the rest of the package
relies on without patching (private methods a subclass overrides, fields it reads): the symbol,
why, and the shape the code assumes (docs/vllm-glue.md is the table). `check_vllm_shapes()` runs
when the backend is selected (`AInferPDExecutor.validate`, in the frontend and in EngineCore,
before any worker starts): if the installed vLLM differs from what the code assumes, the backend
stops with one line naming the symbol and the difference, instead of failing inside a step.

| module | area |
|---|---|
| `executor_class.py` | `Executor.get_class` (the backend's short name), the executor's overrides |
| `kv_connector.py` | the KV-connector factory, base class and metrics the lane's connector uses |
| `engine_config.py` | the engine-config fields the executor reads and sets |
| `scheduler.py` | vLLM's scheduler internals the planner overrides or reads |
| `worker_round.py` | the platform worker's methods the worker overrides to place the round |
| `model_runner.py` | D's model runner, read to build P's batch and attention metadata |
| `forward_context.py` | the forward context and workspace manager, per thread |
| `attention.py` | P's boundaries at each layer's attention call |
| `collectives.py` | P's collectives routed onto D's stream |
| `dp_sync.py` | the per-forward DP all-reduce, carrying each rank's queued P tokens and D rows |
| `streams.py` | vLLM's compute stream at a higher priority (GPU) |
| `cpu_compat.py` | what vLLM's CPU path lacks for expert parallelism |
| `moe_phase.py` | MoE layers: P's calls resolve to P's own expert-parallel state |
"""

from __future__ import annotations

import logging

from vllm_ainfer_pd import TESTED_VLLM_VERSIONS
from vllm_ainfer_pd.vllm_glue.shapes import (
    GlueShapeError,
    Patch,
    check_patches,
    installed_release,
    vllm_at_least,
)

logger = logging.getLogger(__name__)


def check_vllm(found: str) -> None:
    """Support is decided by shape, not by the version string: `GlueShapeError` (one line naming
    the symbol) where a vLLM symbol the backend patches or relies on differs from what its code
    assumes; a release other than the tested ones whose symbols all match runs, with a warning
    naming it. Local build tags (`+cpu`) are ignored."""
    release = found.split("+")[0]
    check_vllm_shapes(release)
    if release not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "vllm-ainfer-pd was tested on vLLM %s; vLLM %s is installed and every one of the %d "
            "vLLM symbols the backend patches or relies on matches it, so the backend runs",
            ", ".join(TESTED_VLLM_VERSIONS), release, len(all_patches()))


def all_patches() -> list[Patch]:
    from vllm_ainfer_pd.vllm_glue import (
        attention,
        collectives,
        cpu_compat,
        dp_sync,
        engine_config,
        executor_class,
        forward_context,
        kv_connector,
        model_runner,
        moe_phase,
        scheduler,
        streams,
        worker_round,
    )

    modules = (executor_class, kv_connector, engine_config, scheduler, worker_round, model_runner,
               forward_context, attention, collectives, dp_sync, streams, cpu_compat, moe_phase)
    return [patch for module in modules for patch in module.PATCHES]


def shape_report() -> list[tuple[Patch, str | None]]:
    """Every patched or relied-on symbol of the installed vLLM's release with what its check
    finds (None: it matches), for every platform: all at once what `check_vllm_shapes` would stop
    at first, to see how far another vLLM release is (`python -m vllm_ainfer_pd.vllm_glue`)."""
    report = []
    release = installed_release()
    for patch in all_patches():
        if not patch.applies(release=release):
            continue
        try:
            patch.check()
            report.append((patch, None))
        except GlueShapeError as exc:
            report.append((patch, str(exc)))
    return report


def check_vllm_shapes(release: str | None = None) -> None:
    """Raise `GlueShapeError` (one line) if a vLLM symbol the backend patches or relies on differs
    from what its code assumes. Symbols of one platform's code path, or of one range of vLLM
    releases, are checked there only (`release`: the installed vLLM's when None)."""
    from vllm.platforms import current_platform

    platform = ("cpu" if current_platform.is_cpu()
                else "cuda" if current_platform.is_cuda() else current_platform.device_type)
    check_patches(all_patches(), platform, release or installed_release())


__all__ = ["GlueShapeError", "Patch", "all_patches", "check_vllm", "check_vllm_shapes",
           "installed_release", "shape_report", "vllm_at_least"]
