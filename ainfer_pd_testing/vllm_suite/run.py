"""Fetch vLLM's source distribution, take its `tests/`, and run chosen test modules in one mode.

- `vllm_tests_dir()`: `pip download --no-deps --no-binary :all: vllm==<the installed release>`
  into the cache (`~/.cache/vllm-ainfer-pd/vllm-sdist/`). pip fetches the file and then fails to
  prepare its metadata (the build needs CUDA's torch); the URL pip resolved is taken from pip's
  log and the same file downloaded directly. Only `tests/` and `pyproject.toml` (pytest's
  markers) are extracted, beside no `vllm/` package, so the tests import the installed vLLM.
- `run_suite(...)`: one pytest process over those modules, in `stock` or `ours` mode, with the
  overlay (`site/sitecustomize.py`, the hub mapping) and the CPU settings; returns the per-test
  results the pytest plugin wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ainfer_pd_testing import ROOT
from ainfer_pd_testing.vllm_suite import BREAK_ENV, LOG_ENV, MODE_ENV, SITE_DIR
from ainfer_pd_testing.vllm_suite.hub import build_hub, hub_env
from vllm_ainfer_pd.vllm_glue.shapes import installed_release

# The installed vLLM's release: its own tests are the ones that fit it.
VLLM_VERSION = installed_release()
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
TOP = f"vllm-{VLLM_VERSION}"


def cache_dir() -> Path:
    from vllm_ainfer_pd.models.generate import cache_root

    return cache_root() / "vllm-sdist"


def fetch_sdist(folder: Path | None = None) -> Path:
    """The sdist, downloaded once through pip (see the module docstring)."""
    folder = Path(folder or cache_dir())
    path = folder / SDIST
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        log = Path(tmp, "pip.log")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"vllm=={VLLM_VERSION}", "-d", tmp, "--log", str(log)],
            capture_output=True, text=True)
        fetched = Path(tmp, SDIST)
        if not fetched.exists():
            # pip found and downloaded the file, then failed in its metadata step.
            text = log.read_text() if log.exists() else ""
            urls = re.findall(r"(https://\S+/" + re.escape(SDIST) + r")", text)
            if not urls:
                raise RuntimeError(f"pip resolved no {SDIST}:\n{proc.stdout}\n{proc.stderr}")
            _download(urls[-1], fetched)
        _check_sdist(fetched)
        fetched.rename(path)
    return path


def _download(url: str, dest: Path) -> None:
    with urllib.request.urlopen(url, timeout=300) as response, open(dest, "wb") as f:
        while chunk := response.read(1 << 20):
            f.write(chunk)


def _check_sdist(path: Path) -> None:
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    if f"{TOP}/tests/conftest.py" not in names or f"{TOP}/PKG-INFO" not in names:
        raise RuntimeError(f"{path} is not vLLM {VLLM_VERSION}'s source distribution")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def vllm_tests_dir() -> Path:
    """A folder holding vLLM's `tests/` and `pyproject.toml` (extracted once)."""
    sdist = fetch_sdist()
    root = sdist.parent / f"{TOP}-tests"
    if (root / ".complete").exists():
        return root
    with tempfile.TemporaryDirectory(dir=sdist.parent) as tmp, tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(f"{TOP}/tests/") or m.name == f"{TOP}/pyproject.toml"]
        tar.extractall(tmp, members=members, filter="data")
        Path(tmp, TOP, ".complete").touch()
        if root.exists():
            import shutil

            shutil.rmtree(root)
        Path(tmp, TOP).rename(root)
    return root


@dataclass
class SuiteRun:
    mode: str
    results: dict[str, dict]  # node id -> outcome, duration, message, steps, lane_jobs
    wall_s: float
    returncodes: dict[str, int]  # test path -> pytest's exit status
    engines: list[str]  # one line per EngineArgs built: "<mode> backend=... model=..."


def suite_env(mode: str, log_dir: Path, broken: str | None = None) -> dict[str, str]:
    from vllm_ainfer_pd.models import ensure_model
    from vllm_ainfer_pd.rollout.cpu_engine import cpu_env

    hub = build_hub(cache_dir() / "hub", ensure_model("tiny", seed=0))
    env = {k: v for k, v in os.environ.items() if k not in (BREAK_ENV,)}
    pythonpath = [str(SITE_DIR), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env.update(cpu_env(1))
    env.update(hub_env(hub))
    # The tests start `vllm serve` by name: this interpreter's scripts first on PATH.
    path = [str(Path(sys.executable).parent), *env.get("PATH", "").split(os.pathsep)]
    env.update({
        "PATH": os.pathsep.join(dict.fromkeys(path)),
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath)),
        MODE_ENV: mode,
        LOG_ENV: str(log_dir),
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        # Some of vLLM's server tests ask for 8,192-token contexts; the tiny model has 4,096
        # positions, and their prompts stay far below either.
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    })
    if broken:
        env[BREAK_ENV] = broken
    return env


def run_suite(mode: str, tests: list[str], out_dir: Path, *, broken: str | None = None,
              deselect: list[str] = (), timeout_s: int = 600, resume: bool = False) -> SuiteRun:
    """One pytest process per entry of `tests` (paths relative to vLLM's checkout root, or node
    ids) in `mode`, one after another; each writes `out_dir/<run>/<entry>.json` and `.log`. With
    `resume`, an entry whose results are complete from an earlier call is not run again."""
    root = vllm_tests_dir()
    name = mode + (f"-broken-{broken}" if broken else "")
    run_dir = Path(out_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    codes: dict[str, int] = {}
    engines: list[str] = []
    wall = 0.0
    for test in tests:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", test)
        report, done = run_dir / f"{slug}.json", run_dir / f"{slug}.done"
        events = run_dir / f"{slug}.events"
        if not (resume and done.exists()):
            done.unlink(missing_ok=True)
            report.unlink(missing_ok=True)
            events.mkdir(exist_ok=True)
            (events / "events.log").write_text("")
            mine = [d for d in deselect if d.startswith(test.split("::")[0])]
            cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", test,
                   "-p", "ainfer_pd_testing.vllm_suite.pytest_plugin",
                   "--vllm-suite-report", str(report), "-p", "no:cacheprovider",
                   f"--timeout={timeout_s}", "-q", "-rfEs",
                   *[f"--deselect={d}" for d in mine]]
            start = time.time()
            with open(run_dir / f"{slug}.log", "w") as f:
                proc = subprocess.run(cmd, cwd=root, env=suite_env(mode, events, broken),
                                      stdout=f, stderr=subprocess.STDOUT)
            done.write_text(json.dumps({"returncode": proc.returncode,
                                        "wall_s": round(time.time() - start, 1)}))
        status = json.loads(done.read_text())
        codes[test] = status["returncode"]
        wall += status["wall_s"]
        results.update(json.loads(report.read_text()) if report.exists() else {})
        lines = (events / "events.log").read_text().splitlines()
        engines += [e.split(" ", 2)[2] for e in lines if e.startswith("engine ")]
    return SuiteRun(mode, results, wall, codes, engines)
