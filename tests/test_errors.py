"""Bad input fails before any engine starts, with one line that names the bad value."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_ainfer_pd.rollout.cpu_engine import cpu_env
from vllm_ainfer_pd.rollout.server import vllm_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _error_lines(output: str, needle: str) -> list[str]:
    return [line for line in output.splitlines() if needle in line]


def test_an_untested_vllm_release_with_matching_symbols_runs_and_is_named(tiny_model):
    code = (
        "import vllm; vllm.__version__ = '0.99.0'\n"
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={tiny_model!r}, distributed_executor_backend='ainfer_pd', "
        "enforce_eager=True)\n"
        "print('tokens', len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]"
        ".outputs[0].token_ids))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, **cpu_env(1)})
    assert run.returncode == 0 and "tokens 4" in run.stdout, run.stderr[-3000:]
    assert "vllm-ainfer-pd was tested on vLLM 0.26.0; vLLM 0.99.0 is installed and every one " \
        "of the" in run.stderr + run.stdout, run.stderr[-3000:]


def test_unknown_option_on_the_cli_is_one_clear_line(tiny_model):
    config = json.dumps({"ainfer_pd": {"segment_spam": 2}})
    run = subprocess.run(
        vllm_command() + ["serve", tiny_model, "--host", "127.0.0.1", "--port", "1",
                          "--distributed-executor-backend", "ainfer_pd",
                          "--additional-config", config],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode != 0
    lines = _error_lines(run.stderr + run.stdout, "ConfigError:")
    assert len(lines) == 1, (run.stderr + run.stdout)[-3000:]
    assert "unknown ainfer_pd option(s) 'segment_spam'; known options: mode" in lines[0]
