"""An attention backend the P lane cannot serve is refused by name in one line: when the backend
is selected for a backend the user names, and in the worker for the one vLLM chose. No engine
starts in these tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_ainfer_pd import attention_backends
from vllm_ainfer_pd.attention_backends import LANE_BACKENDS, REFUSED, check_runner, refusal
from vllm_ainfer_pd.config import ConfigError

pytestmark = pytest.mark.timeout(300)

LANE = {"ainfer_pd": {"p_lane_min_tokens": 32}}


def vllm_config(model: str, attention_backend: str | None, additional_config: dict = LANE):
    """The `VllmConfig` vLLM builds for `LLM(..., attention_backend=...)`; building it selects
    the executor backend, where the check runs."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, distributed_executor_backend="ainfer_pd", enforce_eager=True,
                      attention_backend=attention_backend,
                      additional_config=additional_config).create_engine_config()


def test_every_backend_named_in_the_tables_is_one_of_vllms():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {member.name for member in AttentionBackendEnum}
    assert set(LANE_BACKENDS) - names == set()
    assert set(REFUSED) - names == set()
    assert set(LANE_BACKENDS) & set(REFUSED) == set()


@pytest.mark.parametrize("backend", ["FLASHMLA_SPARSE", "TURBOQUANT", "TRITON_MLA", "FLASHMLA"])
def test_a_named_backend_the_lane_cannot_serve_is_refused_in_one_line_at_selection(
        tiny_model, backend):
    with pytest.raises(ConfigError) as err:
        vllm_config(tiny_model, backend)
    message = str(err.value)
    assert message == refusal(backend) and "\n" not in message
    assert message.startswith(f"ainfer_pd mode='pd' cannot run the P lane on attention backend "
                              f"{backend} (")
    assert "FLASHINFER" in message and "mode='normal'" in message


def test_the_refusal_says_why_for_a_known_reason_and_otherwise_that_the_lane_is_not_built_for_it():
    assert "top-k token indices an indexer computes" in refusal("FLASHMLA_SPARSE")
    assert "differ from stock's by one bf16 step" in refusal("TRITON_MLA")
    assert "no batch-invariant FLASHMLA" in refusal("FLASHMLA")
    assert attention_backends.NOT_BUILT_FOR in refusal("ROCM_ATTN")
    assert all(refusal(name) is None for name in LANE_BACKENDS)


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_named_backends_the_lane_serves_pass_selection(tiny_model, backend):
    config = vllm_config(tiny_model, backend)
    assert config.attention_config.backend.name == backend
    assert config.kv_transfer_config.kv_connector == "AInferPDConnector"  # the lane is on


def test_mode_normal_runs_any_backend_vllm_accepts(tiny_model):
    vllm_config(tiny_model, "FLASHMLA_SPARSE", {"ainfer_pd": {"mode": "normal"}})


class _Backend:
    def __init__(self, name: str) -> None:
        self.get_name = lambda: name


class _Group:
    def __init__(self, name: str) -> None:
        self.backend = _Backend(name)


class _Runner:
    """What `check_runner` reads of vLLM's model runner: its attention groups per KV cache
    group."""

    def __init__(self, *names_per_group: list[str]) -> None:
        self.attn_groups = [[_Group(n) for n in names] for names in names_per_group]


def test_the_backends_vllm_chose_for_the_kv_cache_groups_are_checked_in_the_worker():
    assert check_runner(_Runner(["FLASH_ATTN"], ["FLASH_ATTN"])) == ["FLASH_ATTN"]
    assert check_runner(_Runner(["CPU_ATTN"])) == ["CPU_ATTN"]
    with pytest.raises(ConfigError) as err:
        check_runner(_Runner(["FLASH_ATTN"], ["FLASHMLA_SPARSE"]))
    assert str(err.value) == refusal("FLASHMLA_SPARSE")


@pytest.mark.slow
def test_llm_with_a_backend_the_lane_cannot_serve_fails_in_one_line_before_any_engine(
        tiny_model):
    """`LLM(...)` as users write it: the refusal is the one error line, not a pydantic
    traceback, and comes before an engine process starts."""
    code = ("from vllm import LLM\n"
            f"LLM(model={tiny_model!r}, distributed_executor_backend='ainfer_pd', "
            f"attention_backend='FLASHMLA_SPARSE', additional_config={LANE!r}, "
            f"enforce_eager=True)\n")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=240)
    output = run.stderr + run.stdout
    assert run.returncode != 0
    lines = [line for line in output.splitlines() if "Error:" in line]
    assert lines == [f"vllm_ainfer_pd.config.ConfigError: {refusal('FLASHMLA_SPARSE')}"], \
        output[-3000:]
    assert "ValidationError" not in output and "Initializing a V1 LLM engine" not in output
