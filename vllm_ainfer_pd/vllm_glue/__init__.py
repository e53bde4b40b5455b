"""Every patch of vLLM internals the backend makes, one module per patched area.

Each module lists what it touches in `PATCHES` (the vLLM symbol, why, and the shape the patch
assumes). `check_vllm_shapes()` runs when the backend is selected and in every worker before a
patch is installed: if the installed vLLM differs from what a patch assumes, the backend stops
with one line naming the symbol and the difference, instead of failing somewhere in a step.
"""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import GlueShapeError, Patch, check_patches


def all_patches() -> list[Patch]:
    from vllm_ainfer_pd.vllm_glue import dp_sync

    return [*dp_sync.PATCHES]


def check_vllm_shapes() -> None:
    """Raise `GlueShapeError` (one line) if any patched vLLM symbol differs from its assumption."""
    check_patches(all_patches())


__all__ = ["GlueShapeError", "Patch", "all_patches", "check_vllm_shapes"]
