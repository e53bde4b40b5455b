"""vllm-ainfer-pd: communication-safe in-place prefill/decode multiplexing for vLLM (see README)."""

from __future__ import annotations

__version__ = "0.1.0"
# The vLLM releases the test suite and the GPU results ran on. Another release runs where every
# vLLM symbol the backend patches or relies on matches (`vllm_glue.check_vllm`), with a warning.
TESTED_VLLM_VERSIONS = ("0.26.0", "0.32.0")
BACKEND_NAME = "ainfer_pd"
