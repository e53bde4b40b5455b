"""The protocol package stays free of vLLM, and its benchmark entry point works."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_turnstile_package_imports_no_vllm():
    code = ("import sys, importlib, pkgutil, vllm_ainfer_pd.turnstile as t\n"
            "for m in pkgutil.iter_modules(t.__path__):\n"
            "    if m.name != '__main__':\n"
            "        importlib.import_module('vllm_ainfer_pd.turnstile.' + m.name)\n"
            "bad = sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_module_entry_point_prints_the_rendezvous_table_and_saves_json(tmp_path):
    path = tmp_path / "rdv.json"
    out = subprocess.run([sys.executable, "-m", "vllm_ainfer_pd.turnstile", "--ranks", "2",
                          "--iters", "30", "--json", str(path)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "median us" in out.stdout and "shm" in out.stdout and "gloo" in out.stdout
    rows = json.loads(path.read_text())["rows"]
    assert {(r["impl"], r["ranks"]) for r in rows} == {("shm", 2), ("gloo", 2)}
    assert all(r["median_us"] > 0 and r["p99_us"] >= r["median_us"] for r in rows)
