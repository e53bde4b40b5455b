"""benchmarks/rendezvous_bench.py prints its table and saves its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rendezvous_bench.py"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_script_prints_the_rendezvous_table_and_saves_json(tmp_path):
    path = tmp_path / "rdv.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--iters", "30",
                          "--json", str(path)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "median us" in out.stdout and "shm" in out.stdout and "gloo" in out.stdout
    rows = json.loads(path.read_text())["rows"]
    assert {(r["impl"], r["ranks"]) for r in rows} == {("shm", 2), ("gloo", 2)}
    assert all(r["median_us"] > 0 and r["p99_us"] >= r["median_us"] for r in rows)
