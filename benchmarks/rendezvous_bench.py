"""Rendezvous micro-benchmark: latency of one phase (`pre_d` or `post_d`), gloo vs shared memory.

    python benchmarks/rendezvous_bench.py [--ranks 2 4 8] [--impl shm gloo] [--iters N]
                                          [--json benchmarks/results/cpu/rendezvous.json]

Every rank runs a closed loop of rounds; each phase's wall time on each rank is one sample, so a
sample includes waiting for the slowest rank (what the D thread pays per phase). Reports median and
p99 per (implementation, ranks). When ranks outnumber CPU cores the ranks time-share the cores; the
table marks those rows `oversubscribed` and the numbers then measure scheduling as much as the
barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ainfer_pd_testing.launch import RankGroup, init_gloo  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu",
                            "rendezvous.json")
DEFAULT_ITERS = {"shm": 2000, "gloo": 300}


def _bench_rank(rank: int, world: int, port: int, impl: str, iters: int,
                warmup: int) -> list[float]:
    from vllm_ainfer_pd.turnstile.rendezvous import GlooRendezvous, ShmRendezvous

    if impl == "gloo":
        init_gloo(rank, world, port)
        rdv: Any = GlooRendezvous(timeout_s=60, name="bench")
    else:
        rdv = ShmRendezvous(f"ainfer_pd_bench_{port}", rank, world, timeout_s=60)
    try:
        for _ in range(warmup):
            rdv.pre_d()
            rdv.post_d()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            rdv.pre_d()
            t1 = time.perf_counter()
            rdv.post_d()
            samples += [t1 - t0, time.perf_counter() - t1]
        rdv.pre_d()  # nobody still reads the segment when its creator unlinks it
        return samples
    finally:
        rdv.close()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def measure(impl: str, world: int, iters: int, warmup: int = 50) -> dict[str, Any]:
    """One row: latency statistics of `iters` rounds (2 phases each) on `world` ranks."""
    with RankGroup(_bench_rank, world, args=(impl, iters, warmup)) as ranks:
        per_rank = ranks.wait(120 + iters * world * 0.05)
    samples = sorted(s for rank in per_rank for s in rank)
    cpus = os.cpu_count() or 1
    return {"impl": impl, "ranks": world, "phases_per_rank": 2 * iters,
            "median_us": 1e6 * statistics.median(samples), "p99_us": 1e6 * percentile(samples, 99),
            "mean_us": 1e6 * statistics.fmean(samples), "oversubscribed": world > cpus}


def run(ranks: list[int], impls: list[str], iters: dict[str, int],
        log: Any = print) -> dict[str, Any]:
    rows = []
    for impl in impls:
        for world in ranks:
            row = measure(impl, world, iters[impl])
            rows.append(row)
            log(f"[rendezvous-bench] {impl:>4} x{world}: median {row['median_us']:9.1f} us, "
                f"p99 {row['p99_us']:9.1f} us")
    import torch

    # The load average says whether other work shared the CPUs during the measurement.
    host = {"cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_1m": round(os.getloadavg()[0], 2)}
    return {"host": host, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    host = result["host"]
    lines = [f"Rendezvous latency per phase (pre_d or post_d); host: {host['cpus']} CPUs, "
             f"load average {host['load_avg_1m']}, torch {host['torch']}",
             f"{'impl':<6} {'ranks':>5} {'median us':>11} {'p99 us':>11} {'mean us':>11}  note",
             "-" * 62]
    for r in result["rows"]:
        note = f"oversubscribed ({r['ranks']} ranks > {host['cpus']} CPUs)" \
            if r["oversubscribed"] else ""
        lines.append(f"{r['impl']:<6} {r['ranks']:>5} {r['median_us']:>11.1f} "
                     f"{r['p99_us']:>11.1f} {r['mean_us']:>11.1f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--impl", nargs="+", choices=("shm", "gloo"), default=["shm", "gloo"])
    ap.add_argument("--iters", type=int, default=None,
                    help=f"rounds per row (default {DEFAULT_ITERS})")
    ap.add_argument("--json", default=DEFAULT_JSON, help="write the result here")
    args = ap.parse_args(argv)
    iters = {k: args.iters or v for k, v in DEFAULT_ITERS.items()}
    result = run(args.ranks, args.impl, iters)
    print(format_table(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
