"""benchmarks/profile_lane.py's trace reading on a hand-made Kineto trace: who launched each
kernel, the overlap of P's kernels with D's, and P's blocking calls."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "profile_lane", Path(__file__).parents[1] / "benchmarks" / "profile_lane.py")
pl = sys.modules["profile_lane"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pl)


def call(tid, name, ts, dur, corr=None):
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": "cuda_runtime", "tid": tid, "name": name, "ts": ts, "dur": dur,
            "args": args}


def kernel(corr, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "pid": 0, "tid": stream, "name": "k", "ts": ts,
            "dur": dur, "args": {"correlation": corr, "stream": stream, "device": 0}}


# D (tid 1) replays a graph of two kernels over [0, 200) us; P (tid 2) runs kernels over [50, 150)
# and [300, 400) on its own stream and blocks once on a stream sync; one kernel has no launch.
EVENTS = [
    call(1, "cudaGraphLaunch", 0, 5, corr=10),
    kernel(10, 7, 0, 100), kernel(10, 7, 100, 100),
    call(2, "cudaLaunchKernel", 40, 3, corr=20), kernel(20, 13, 50, 100),
    call(2, "cudaStreamSynchronize", 160, 80),
    call(2, "cudaLaunchKernel", 290, 3, corr=21), kernel(21, 13, 300, 100),
    kernel(99, 7, 500, 10),
    {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "python"}},
]


def test_overlap_is_p_kernel_time_inside_d_kernel_time():
    r = pl.analyze(EVENTS)
    assert r["found_d_thread"]
    assert (r["d_busy_ms"], r["p_busy_ms"]) == (pytest.approx(0.2), pytest.approx(0.2))
    assert r["p_overlapped_by_d_ms"] == pytest.approx(0.1)  # [50, 150) lies inside [0, 200)
    assert r["p_overlap_fraction"] == pytest.approx(0.5)
    assert r["window_ms"] == pytest.approx(0.4)  # the unattributed kernel is not in the window
    assert r["unattributed_device_ops"] == 1
    # By stream, launchers aside: stream 7 holds D's kernels and the unattributed one.
    assert r["stream_busy_ms"] == {"7": pytest.approx(0.21), "13": pytest.approx(0.2)}
    assert r["stream_overlap_ms"] == {"13&7": pytest.approx(0.1)}


def test_threads_show_roles_streams_and_blocking_calls():
    threads = {t["tid"]: t for t in pl.analyze(EVENTS)["threads"]}
    assert threads[1]["role"] == "D" and threads[1]["streams"] == [7]
    p = threads[2]
    assert p["role"] == "other" and p["streams"] == [13] and p["device_ops"] == 2
    assert p["blocking_calls"] == {"cudaStreamSynchronize": {"count": 1, "ms": pytest.approx(0.08)}}
    assert p["longest_calls"][0]["name"] == "cudaStreamSynchronize"


def test_a_trace_without_graph_launches_reports_no_d_thread(tmp_path):
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [e for e in EVENTS if e.get("name") != "cudaGraphLaunch"]}, f)
    r = pl.analyze(pl.load_events(path))
    assert not r["found_d_thread"] and r["d_busy_ms"] == 0 and r["p_overlapped_by_d_ms"] == 0


def test_analyze_only_cli_writes_the_summary(tmp_path, monkeypatch, capsys):
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    monkeypatch.setattr(sys, "argv", ["profile_lane.py", "--analyze", str(path),
                                      "--out", str(tmp_path / "out")])
    pl.main()
    summary = json.loads((tmp_path / "out" / "profile_summary.json").read_text())
    assert summary["traces"][path.name]["p_overlap_fraction"] == pytest.approx(0.5)
    assert "overlapped 0.1 ms (0.500)" in capsys.readouterr().out
