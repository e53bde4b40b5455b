"""vllm-ainfer-pd: communication-safe in-place prefill/decode multiplexing for vLLM (see README)."""

from __future__ import annotations

__version__ = "0.1.0"
SUPPORTED_VLLM_VERSION = "0.26.0"
BACKEND_NAME = "ainfer_pd"
