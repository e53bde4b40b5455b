"""Fixtures shared by the whole suite: the generated tiny models (cached across runs)."""

from __future__ import annotations

import pytest

# Imported for its side effect: this checkout on PYTHONPATH, so that the processes tests start
# (`vllm serve`, scripts, vLLM's workers) can import the harness's worker extensions.
import ainfer_pd_testing  # noqa: F401
from vllm_ainfer_pd.models import ensure_model


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(ensure_model("tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_model_other_seed() -> str:
    """Same shape, different random weights: a model whose tokens must NOT pass the parity bar."""
    return str(ensure_model("tiny", seed=1))
