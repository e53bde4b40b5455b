"""The scale model's lane against the product's, on the CPU at DP=2 + EP, with and without the
epoch gate: the real lane's epochs, P tokens per epoch and rank utilisation (its counters) beside
the model replaying the same trace with the CPU profile.

    python benchmarks/gate_check_cpu.py [--reps 2] [--seeds 4] \
        [--out benchmarks/results/cpu/gate_check]

Two servers one after another (`rollout compare`, client waits x 1; the trace: the `cpu`
preset's trajectories for trace seeds 0 .. N-1 together, so that an epoch more or less is a few
percent of the count, not one in eight as with one seed's 16 trajectories): the lane
taking every prompt (`p_lane_min_tokens=2`) with the gate off, and the same with the gate as
the lane's defaults set it at DP > 1 (`epoch_gate_fill=0.8`, `epoch_gate_rounds=96`). Counters
are per replay (settled: every rank's report in), summed over ranks; epochs run in lockstep,
so a rank's epoch count is the sum over DP. Rank utilisation is all ranks' epoch tokens over
DP x the fullest rank's (`vllm_ainfer_pd_epoch_all_rank_tokens` / (DP x
`..._epoch_max_rank_tokens`)). Writes `gate_check.md` / `.json` beside the rollout report.
Not a speed result: on 2 shared cores P cannot overlap D.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scale import EngineSpec, Layout, load_profile, simulate  # noqa: E402
from vllm_ainfer_pd.rollout.generator import generate  # noqa: E402
from vllm_ainfer_pd.rollout.trace import Trace, dump_trace, load_trace  # noqa: E402

DP = 2
# Both name every setting they compare, so that a change of the lane's defaults does not change
# what they ran: every prompt through the lane, the gate off, then as the defaults set it.
LANE_ALL = {"p_lane_min_tokens": 2, "epoch_gate_fill": 0.0}
GATE = {**LANE_ALL, "epoch_gate_fill": 0.8, "epoch_gate_rounds": 96}
BACKENDS = {"pd_all": LANE_ALL, "pd_gate": GATE}
PREFIX = "vllm_ainfer_pd_"


def seeds_together(seeds: int) -> Trace:
    """The `cpu` preset's trajectories of trace seeds 0 .. seeds-1, in one trace (ids prefixed by
    their seed)."""
    trajectories = [dataclasses.replace(t, id=f"s{seed}-{t.id}")
                    for seed in range(seeds) for t in generate("cpu", seed).trajectories]
    return Trace(tuple(trajectories), {"preset": "cpu", "seeds": list(range(seeds))})


def measured(report: dict, backend: str) -> dict[str, float]:
    """Median over the backend's replays of the three figures."""
    rows = []
    for run in report["backends"][backend]["runs"]:
        c = run["counters"]
        epochs = c[PREFIX + "epochs_total"] / DP
        rows.append({"epochs": epochs,
                     "p_tokens_per_epoch": c[PREFIX + "p_tokens_total"] / max(1.0, epochs),
                     "rank_utilisation": c[PREFIX + "epoch_all_rank_tokens_total"]
                     / max(1.0, DP * c[PREFIX + "epoch_max_rank_tokens_total"])})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {
        f"{k}_range": [min(r[k] for r in rows), max(r[k] for r in rows)] for k in rows[0]}


def modelled(trace, lane: dict) -> dict[str, float]:
    profile = load_profile(ROOT / "benchmarks" / "results" / "scale" / "profile_cpu_tiny.json")
    res = simulate(trace, profile, Layout(dp=DP, ep=True),
                   EngineSpec("pd", lane=tuple(lane.items())), wait_scale=1.0)
    c = res.counters
    return {"epochs": c["epochs"], "p_tokens_per_epoch": c["lane_tokens"] / max(1, c["epochs"]),
            "rank_utilisation": c["lane_tokens"] / max(1, c["epoch_rank_tokens"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seeds", type=int, default=4, help="trace seeds in the one trace")
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks" / "results" / "cpu" / "gate_check")
    p.add_argument("--skip-run", action="store_true", help="compare the stored report only")
    args = p.parse_args()
    if not args.skip_run:
        subprocess.run([sys.executable, "-m", "vllm_ainfer_pd.models", "--preset", "tiny"],
                       check=True, stdout=subprocess.DEVNULL)
        args.out.mkdir(parents=True, exist_ok=True)
        dump_trace(seeds_together(args.seeds), args.out / "trace-in.jsonl")
        cmd = [sys.executable, "-m", "vllm_ainfer_pd.rollout", "compare",
               "--trace", str(args.out / "trace-in.jsonl"),
               "--dp", str(DP), "--enable-expert-parallel", "--reps", str(args.reps),
               "--schedule", "sequential", "--no-progress", "--out", str(args.out),
               "--only", ",".join(BACKENDS)]
        for name, lane in BACKENDS.items():
            cmd += ["--variant", f"{name}={json.dumps({'ainfer_pd': lane})}"]
        subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ)
    report = json.loads((args.out / "report.json").read_text())
    trace = load_trace(args.out / "trace.jsonl")
    rows = []
    for name, lane in BACKENDS.items():
        meas, model = measured(report, name), modelled(trace, lane)
        rows.append({"backend": name, "lane": lane, "measured": meas, "model": model,
                     "model_over_measured": {k: model[k] / meas[k] for k in model}})
    lines = ["# The model's lane against the product's (CPU, DP=2 + EP)", "",
             f"`python benchmarks/gate_check_cpu.py --reps {args.reps} --seeds {args.seeds}`; "
             "measured: median over "
             "the replays [range]; model: one replay of the same trace "
             "(`profile_cpu_tiny.json`). Bold: the model outside +-10% of the measured median.",
             "", "| backend | lane options | epochs meas. / model | P tokens per epoch meas. / "
             "model | rank utilisation meas. / model |", "|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for k, fmt in (("epochs", "{:.0f}"), ("p_tokens_per_epoch", "{:.0f}"),
                       ("rank_utilisation", "{:.2f}")):
            err = r["model_over_measured"][k] - 1
            mark = "**" if abs(err) > 0.10 else ""
            lo, hi = r["measured"][f"{k}_range"]
            cells.append(f"{fmt.format(r['measured'][k])} [{fmt.format(lo)}, {fmt.format(hi)}]"
                         f" / {fmt.format(r['model'][k])} ({mark}{100 * err:+.0f}%{mark})")
        lines.append(f"| {r['backend']} | `{json.dumps(r['lane'])}` | " + " | ".join(cells) + " |")
    (args.out / "gate_check.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "gate_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
