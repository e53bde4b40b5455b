"""Profile a `pd` server under a rollout with the torch profiler, and read from the device trace how
much of P's kernel time overlapped D's, and where P's thread waited on the host.

    python benchmarks/profile_lane.py --platform gpu --model .gpu/gpu-model --preset gpu-quick \
        --wait-scale 0.1 --delay-iterations 200 --max-iterations 400 --out $OUT/profile_tp1

The server runs with vLLM's own profiler (`--profiler-config`, started and stopped through
`/start_profile` and `/stop_profile` around one replay; the delay and limit count engine steps,
so the capture is a window of the rollout, not all of it). The worker's trace is then read:

- **Who launched a kernel.** Each kernel's correlation id leads to the runtime or driver call that
  launched it, and that call's thread. D's thread is the one that launches CUDA graphs (vLLM's
  decode replays); every other thread that launches kernels is P's (the lane starts one per epoch)
  or a helper, listed per thread so nothing is hidden.
- **Overlap.** The union of P's kernel intervals intersected with the union of D's, over P's:
  the exact kernel-level figure that the lane's CUDA-event meter (`overlap_timing`) bounds from
  above.
- **P's host waits.** The runtime calls on P's threads that block the host (`*Synchronize`,
  blocking `cudaMemcpy`), and P's longest runtime calls: a sync inside P's forward would make its
  host enqueue as slow as its device work and make D wait for it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _is_blocking(name: str) -> bool:
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpy", "cuMemcpyDtoH_v2")


def analyze(events: list[dict]) -> dict:
    """Overlap and P's host waits from one process's Kineto trace events (times in us)."""
    launches: dict[int, dict] = {}  # correlation id -> the runtime/driver call that launched it
    calls_by_tid: dict[int, list[dict]] = defaultdict(list)
    device: list[dict] = []
    categories: dict[str, int] = defaultdict(int)
    for e in events:
        cat = e.get("cat", "")
        categories[cat] += 1
        if e.get("ph") != "X":
            continue
        if cat in LAUNCH_CATEGORIES:
            calls_by_tid[e["tid"]].append(e)
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat in DEVICE_CATEGORIES:
            device.append(e)

    d_tids = {tid for tid, calls in calls_by_tid.items()
              if any(c["name"] in GRAPH_LAUNCH for c in calls)}
    by_tid: dict[int, list[tuple[float, float]]] = defaultdict(list)
    streams: dict[int, set] = defaultdict(set)
    unattributed = 0
    for k in device:
        call = launches.get(k.get("args", {}).get("correlation"))
        if call is None:
            unattributed += 1
            continue
        by_tid[call["tid"]].append((k["ts"], k["ts"] + k["dur"]))
        streams[call["tid"]].add(k.get("args", {}).get("stream"))

    threads = []
    for tid in sorted(set(by_tid) | set(calls_by_tid)):
        calls = calls_by_tid.get(tid, [])
        blocking: dict[str, list[float]] = defaultdict(list)
        for c in calls:
            if _is_blocking(c["name"]):
                blocking[c["name"]].append(c["dur"])
        threads.append({
            "tid": tid,
            "role": "D" if tid in d_tids else "other",
            "device_busy_ms": _length(_union(by_tid.get(tid, []))) / 1e3,
            "device_ops": len(by_tid.get(tid, [])),
            "streams": sorted(s for s in streams.get(tid, ()) if s is not None),
            "runtime_calls": len(calls),
            "runtime_ms": sum(c["dur"] for c in calls) / 1e3,
            "blocking_calls": {n: {"count": len(d), "ms": sum(d) / 1e3}
                               for n, d in sorted(blocking.items())},
            "longest_calls": [{"name": c["name"], "ms": c["dur"] / 1e3}
                              for c in sorted(calls, key=lambda c: -c["dur"])[:5]],
        })

    # By stream too, launcher or not: if the launching calls are missing from a trace, which
    # stream is P's (the lane's own) still shows, and so does its overlap with every other.
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for k in device:
        by_stream[str(k.get("args", {}).get("stream"))].append((k["ts"], k["ts"] + k["dur"]))
    stream_busy = {s: _union(ivs) for s, ivs in sorted(by_stream.items())}
    # Only the pairs that overlap at all: a graph replay can spread over hundreds of streams
    # (MLA's captured graphs do), and every pair of those would fill the summary with zeros.
    stream_overlap = {}
    for i, a in enumerate(stream_busy):
        for b in list(stream_busy)[i + 1:]:
            if ms := _intersection(stream_busy[a], stream_busy[b]) / 1e3:
                stream_overlap[f"{a}&{b}"] = ms

    d_busy = _union([iv for tid in d_tids for iv in by_tid.get(tid, [])])
    p_busy = _union([iv for tid, ivs in by_tid.items() if tid not in d_tids for iv in ivs])
    p_ms, d_ms = _length(p_busy) / 1e3, _length(d_busy) / 1e3
    overlap_ms = _intersection(p_busy, d_busy) / 1e3
    span = [iv for ivs in by_tid.values() for iv in ivs]
    return {
        "found_d_thread": bool(d_tids),
        "window_ms": (max(e for _, e in span) - min(s for s, _ in span)) / 1e3 if span else 0.0,
        "d_busy_ms": d_ms,
        "p_busy_ms": p_ms,  # every thread but D's: P's epochs and any helper (see `threads`)
        "p_overlapped_by_d_ms": overlap_ms,
        "p_overlap_fraction": overlap_ms / p_ms if p_ms else None,
        "device_busy_ms": _length(_union(span)) / 1e3,
        "unattributed_device_ops": unattributed,
        "stream_busy_ms": {st: _length(ivs) / 1e3 for st, ivs in stream_busy.items()},
        "stream_overlap_ms": stream_overlap,
        "threads": threads,
        "event_categories": dict(sorted(categories.items())),
    }


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def _post(url: str, timeout_s: float) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the tiny preset)")
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="gpu")
    ap.add_argument("--preset", default="gpu-quick", help="rollout trace preset")
    ap.add_argument("--wait-scale", type=float, default=0.1)
    ap.add_argument("--additional-config", default='{"ainfer_pd": {"overlap_timing": true}}')
    ap.add_argument("--delay-iterations", type=int, default=200,
                    help="engine steps after /start_profile before the capture starts")
    ap.add_argument("--max-iterations", type=int, default=400, help="engine steps captured")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--analyze", type=Path, nargs="*", default=None,
                    help="only read these trace files (no server)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    traces = _profile(args) if args.analyze is None else args.analyze
    summary = {"traces": {path.name: analyze(load_events(path)) for path in traces}}
    for name, r in summary["traces"].items():
        fraction = r["p_overlap_fraction"]
        print(f"{name}: D busy {r['d_busy_ms']:.1f} ms, P busy {r['p_busy_ms']:.1f} ms, "
              f"overlapped {r['p_overlapped_by_d_ms']:.1f} ms "
              f"({'n/a' if fraction is None else f'{fraction:.3f}'}), "
              f"window {r['window_ms']:.1f} ms; streams busy over 1 ms: "
              f"{ {st: round(ms, 1) for st, ms in r['stream_busy_ms'].items() if ms > 1} }",
              flush=True)
        for t in r["threads"]:
            print(f"  tid {t['tid']} ({t['role']}): device {t['device_busy_ms']:.1f} ms in "
                  f"{t['device_ops']} ops on streams {t['streams']}, {t['runtime_calls']} calls "
                  f"{t['runtime_ms']:.1f} ms, blocking {t['blocking_calls']}", flush=True)
    (args.out / "profile_summary.json").write_text(json.dumps(summary, indent=1))
    if not traces:
        sys.exit("no trace file was written")


def _profile(args) -> list[Path]:
    from vllm_ainfer_pd.models import ensure_model
    from vllm_ainfer_pd.rollout.compare import WARMUP, CompareConfig
    from vllm_ainfer_pd.rollout.generator import generate
    from vllm_ainfer_pd.rollout.metrics import summarize
    from vllm_ainfer_pd.rollout.replayer import ReplayConfig, replay
    from vllm_ainfer_pd.rollout.server import VllmServer

    model = args.model or str(ensure_model("tiny", 0))
    prof_dir = (args.out / "torch_traces").resolve()
    profiler = {"profiler": "torch", "torch_profiler_dir": str(prof_dir),
                "torch_profiler_with_stack": False, "ignore_frontend": True,
                "delay_iterations": args.delay_iterations,
                "max_iterations": args.max_iterations}
    cfg = CompareConfig(model, args.out, platform=args.platform, progress=False)
    server_args = cfg.common_args() + [
        "--distributed-executor-backend", "ainfer_pd",
        "--additional-config", args.additional_config,
        "--profiler-config", json.dumps(profiler)]
    trace = generate(args.preset, 0)
    with VllmServer(model, server_args, cfg.env(), name="profile-pd") as srv:
        print(f"server up at {srv.url}", flush=True)
        replay(WARMUP, ReplayConfig(srv.url, id_seed=-1, progress=False))
        _post(srv.url + "/start_profile", 60)
        res = replay(trace, ReplayConfig(srv.url, wait_scale=args.wait_scale, progress=False))
        s = summarize(res.records)
        print(f"replay: makespan {s['makespan_s']:.2f} s, {s['completed']}/{s['requests']} "
              f"completed", flush=True)
        t = time.monotonic()
        _post(srv.url + "/stop_profile", 600)  # the worker writes its trace before answering
        print(f"profiler stopped in {time.monotonic() - t:.0f} s", flush=True)
        (args.out / "server.log").write_text(srv.log_text())
    return sorted(p for p in prof_dir.rglob("*") if p.is_file() and ".json" in p.name)


if __name__ == "__main__":
    main()
