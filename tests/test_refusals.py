"""ainfer_pd options with another executor backend are refused in one line, not ignored: TRL's
colocate mode (`external_launcher`) or vLLM's default backends would otherwise run stock vLLM
while the user believes the P lane is on. No engine starts in these tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_ainfer_pd.config import ConfigError
from vllm_ainfer_pd.refusals import refuse_options_without_backend

pytestmark = pytest.mark.timeout(300)

OPTIONS = {"ainfer_pd": {"mode": "pd"}}


def vllm_config(model: str, backend, additional_config: dict = OPTIONS):
    """A `VllmConfig` as vLLM builds it for an engine; building it resolves the executor class
    (`VllmConfig.__post_init__` calls `Executor.get_class`), where the refusal runs."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, distributed_executor_backend=backend, enforce_eager=True,
                      additional_config=additional_config).create_engine_config()


def refusal(backend: str) -> str:
    return (f"additional_config['ainfer_pd'] is set but distributed_executor_backend={backend!r} "
            f"ignores it: the ainfer_pd options need distributed_executor_backend='ainfer_pd' "
            f"(--distributed-executor-backend ainfer_pd), or remove them")


@pytest.mark.parametrize("backend", ["mp", "external_launcher"])
def test_ainfer_pd_options_with_another_backend_are_refused_naming_it(tiny_model, backend):
    with pytest.raises(ConfigError) as err:
        vllm_config(tiny_model, backend)
    assert str(err.value) == refusal(backend)


def test_ainfer_pd_options_with_vllms_default_backend_are_refused(tiny_model):
    """No backend given: vLLM picks one of its own (`uni` for one process), which the error
    names."""
    with pytest.raises(ConfigError, match=r"distributed_executor_backend='(uni|mp)' ignores it"):
        vllm_config(tiny_model, None)


def test_the_options_with_this_backend_by_name_class_or_path_are_accepted(tiny_model):
    from vllm_ainfer_pd.executor import AInferPDExecutor

    for backend in ("ainfer_pd", "vllm_ainfer_pd.executor.AInferPDExecutor", AInferPDExecutor):
        config = vllm_config(tiny_model, backend)
        refuse_options_without_backend(config)  # and directly, on the config built


def test_another_backend_without_the_options_is_left_alone(tiny_model):
    vllm_config(tiny_model, "mp", {"fp32_lm_head": True})  # another plugin's keys
    vllm_config(tiny_model, "mp", {})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mp", "external_launcher"])
def test_llm_with_the_options_and_another_backend_fails_in_one_line_before_any_engine(
        tiny_model, backend):
    """`LLM(...)` as users (and TRL's colocate mode, with `external_launcher`) write it: the
    error comes from where vLLM resolves the executor class, before an engine process starts."""
    code = ("from vllm import LLM\n"
            f"LLM(model={tiny_model!r}, distributed_executor_backend={backend!r}, "
            f"additional_config={OPTIONS!r}, enforce_eager=True)\n")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=240)
    output = run.stderr + run.stdout
    assert run.returncode != 0
    lines = [line for line in output.splitlines() if "ConfigError:" in line]
    assert lines == [f"vllm_ainfer_pd.config.ConfigError: {refusal(backend)}"], output[-3000:]
    # vLLM logs this line from the engine core it starts; the refusal comes first.
    assert "Initializing a V1 LLM engine" not in output, output[-3000:]
