"""A non-editable install of the package alone runs what users run: a copy of the checkout holding
only `setup.py` and `vllm_ainfer_pd/` is `pip install`ed into a fresh folder, and its console
scripts run from elsewhere with only that folder on the path (vLLM and torch come from this
environment). So nothing they need lies outside the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the package was installed into (`pip install --target`)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT / "vllm_ainfer_pd", src / "vllm_ainfer_pd",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "setup.py", src)
    site = tmp / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=240, cwd=tmp,
                         env=clean_env(None))
    assert out.returncode == 0, out.stdout + out.stderr
    return site


def clean_env(site: Path | None) -> dict[str, str]:
    """This environment with only `site` on PYTHONPATH (the test harness puts the checkout
    there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def run(site: Path, cwd: Path, *argv: str) -> str:
    out = subprocess.run([str(site / "bin" / argv[0]), *argv[1:]], capture_output=True,
                         text=True, timeout=120, cwd=cwd, env=clean_env(site))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_wheel_holds_only_the_package(installed):
    top = {p.name for p in installed.iterdir()}
    assert top == {"bin", "vllm_ainfer_pd", "vllm_ainfer_pd-0.1.0.dist-info"}
    assert (installed / "vllm_ainfer_pd" / "models" / "corpus.txt").is_file()
    assert not (installed / "vllm_ainfer_pd" / "rollout" / "scale").exists()


def test_the_console_scripts_run_from_the_installed_package(installed, tmp_path):
    where = subprocess.run([sys.executable, "-c", "import vllm_ainfer_pd; "
                            "print(vllm_ainfer_pd.__file__)"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=clean_env(installed))
    assert where.stdout.strip() == str(installed / "vllm_ainfer_pd" / "__init__.py")
    help_text = run(installed, tmp_path, "vllm-ainfer-pd-rollout", "--help")
    assert "{generate,stats,replay,compare,merge,ttft}" in help_text
    assert "--preset" in run(installed, tmp_path, "vllm-ainfer-pd-model", "--help")
    assert "trajectories" in run(installed, tmp_path, "vllm-ainfer-pd-rollout", "stats",
                                 "--preset", "cpu")
    run(installed, tmp_path, "vllm-ainfer-pd-model", "--preset", "tiny", "--out",
        str(tmp_path / "tiny"))
    assert (tmp_path / "tiny" / "config.json").is_file()
