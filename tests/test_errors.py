"""Bad input fails before any engine starts, with one line that names the bad value."""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_ainfer_pd.rollout.server import vllm_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _error_lines(output: str, needle: str) -> list[str]:
    return [line for line in output.splitlines() if needle in line]


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
