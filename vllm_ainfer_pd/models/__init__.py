"""Generated random-weight MoE models (see generate.py)."""

from __future__ import annotations

from vllm_ainfer_pd.models.generate import PRESETS, ModelPreset, ensure_model, write_model

__all__ = ["PRESETS", "ModelPreset", "ensure_model", "write_model"]
