"""Validation: the model replays every measured rollout in `benchmarks/results/` that has a trace
and a result, and its makespan, p99 TTFT and TPOT p50 are set against the measured medians.

Which runs, and how the model sees each (the engine with the lane's settings of the time, the
profile of its device and model, its layout), is data beside the results:
`benchmarks/results/scale/runs.json`, with the runs left out and why. Nothing here is fitted per
run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.scale.costs import Layout
from benchmarks.scale.engines import EngineSpec
from benchmarks.scale.profile import Profile, load_profile
from benchmarks.scale.sim import simulate
from vllm_ainfer_pd.rollout.trace import Trace, load_trace

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results, beside this package
METRICS = (("makespan_s", "makespan (s)"), ("ttft_s.p99", "p99 TTFT (s)"),
           ("tpot_s.p50", "TPOT p50 (ms)"))
TARGET = 0.10


@dataclass(frozen=True)
class Run:
    call: str  # the report's folder under benchmarks/results/
    backend: str  # its name in that report
    engine: EngineSpec
    profile: str  # a key of `Runs.profiles`
    layout: Layout = field(default_factory=Layout)
    group: str = "main"  # "main": stock / normal / pd as shipped; "variant": other lane settings
    note: str = ""


@dataclass(frozen=True)
class Runs:
    """`runs.json`: the runs to validate, their profiles' files (by key), and the measured runs
    left out (what, why)."""

    runs: tuple[Run, ...]
    profiles: dict[str, str]
    excluded: tuple[tuple[str, str], ...]


def load_runs(path: Path) -> Runs:
    raw = json.loads(path.read_text())
    profiles = raw["profiles"]
    runs = []
    for section in raw["sections"]:
        for r in section["runs"]:
            engine = EngineSpec(r["engine"], cadence=r.get("cadence", 1),
                                lane=tuple(r.get("lane", {}).items()),
                                async_scheduling=r.get("async_scheduling"))
            if r["profile"] not in profiles:
                raise ValueError(f"{path}: {r['call']} {r['backend']}: unknown profile "
                                 f"{r['profile']!r}; known: {', '.join(profiles)}")
            runs.append(Run(r["call"], r["backend"], engine, r["profile"],
                            Layout(**r.get("layout", {})), r.get("group", "main"),
                            r.get("note", "")))
    return Runs(tuple(runs), dict(profiles), tuple((e["runs"], e["why"]) for e in raw["excluded"]))


def trace_for(report: dict[str, Any], folder: Path) -> Trace:
    """The replayed trace: `trace.jsonl` beside the report or in its parent folder, else
    generated again from the report's preset and seed (the generator is deterministic)."""
    from vllm_ainfer_pd.rollout.generator import generate

    for cand in (folder / "trace.jsonl", folder.parent / "trace.jsonl"):
        if cand.is_file():
            return load_trace(cand)
    source = str(report["meta"].get("trace_source", ""))
    parts = source.split()
    if len(parts) == 4 and parts[0] == "preset" and parts[2] == "seed":
        return generate(parts[1], int(parts[3]))
    raise ValueError(f"{folder}: no trace.jsonl and no preset in trace_source {source!r}")


def measured(report: dict[str, Any], backend: str) -> dict[str, Any]:
    agg = report["backends"][backend]["aggregate"]
    out: dict[str, Any] = {k: agg[k]["median"] for k, _ in METRICS}
    out["reps"] = int(agg["makespan_s"]["n"])
    out["range"] = {k: [agg[k]["q1"], agg[k]["q3"]] for k, _ in METRICS}
    cached = agg.get("vllm:prompt_tokens_cached_total", {}).get("median")
    out["cached_tokens"] = cached
    return out


def predicted(summary: dict[str, Any]) -> dict[str, float]:
    return {"makespan_s": summary["makespan_s"], "ttft_s.p99": summary["ttft_s"]["p99"],
            "tpot_s.p50": summary["tpot_s"]["p50"]}


def validate(root: Path = RESULTS, profiles_dir: Path | None = None,
             runs: Runs | None = None) -> list[dict[str, Any]]:
    """One row per run (default: `root/scale/runs.json`'s); profiles from `profiles_dir`
    (default: `root/scale`)."""
    profiles_dir = profiles_dir or root / "scale"
    runs = runs or load_runs(root / "scale" / "runs.json")
    loaded: dict[str, Profile] = {}
    rows = []
    for run in runs.runs:
        folder = root / run.call
        report = json.loads((folder / "report.json").read_text())
        prof = loaded.get(run.profile) or load_profile(profiles_dir / runs.profiles[run.profile])
        loaded[run.profile] = prof
        wait_scale = float(report["meta"].get("wait_scale", 1.0))
        trace = trace_for(report, folder)
        sim = simulate(trace, prof, run.layout, run.engine, wait_scale)
        meas = measured(report, run.backend)
        pred = predicted(sim.summary)
        err = {k: pred[k] / meas[k] - 1.0 for k, _ in METRICS}
        rows.append({"call": run.call, "backend": run.backend, "engine": run.engine.label,
                     "lane": dict(run.engine.lane), "profile": run.profile,
                     "layout": str(run.layout), "wait_scale": wait_scale, "group": run.group,
                     "note": run.note, "measured": meas, "predicted": pred, "error": err,
                     "within": all(abs(e) <= TARGET for e in err.values()),
                     "model_counters": sim.counters})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| call | server | engine | layout | waits x | "
            + " | ".join(f"{label} meas. / model (err.)" for _, label in METRICS)
            + " | within +-10% |")
    lines = [head, "|" + "---|" * (6 + len(METRICS))]
    for r in rows:
        cells = []
        for key, _ in METRICS:
            scale = 1e3 if key.startswith("tpot") else 1.0
            m, p, e = r["measured"][key] * scale, r["predicted"][key] * scale, r["error"][key]
            flag = "" if abs(e) <= TARGET else "**"
            cells.append(f"{m:.3g} / {p:.3g} ({flag}{100 * e:+.1f}%{flag})")
        engine = r["engine"] + (" " + ",".join(f"{k}={v}" for k, v in r["lane"].items())
                                if r["lane"] else "")
        lines.append(f"| {r['call'].split('/', 1)[1]} | {r['backend']} | {engine} | "
                     f"{r['layout']} | {r['wait_scale']:g} | " + " | ".join(cells)
                     + f" | {'yes' if r['within'] else 'no'} |")
    return "\n".join(lines)


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for group in ("main", "variant", "calibration"):
        sel = [r for r in rows if r["group"] == group]
        if not sel:
            continue
        for platform in ("gpu", "cpu"):
            part = [r for r in sel if r["call"].startswith(platform)]
            if not part:
                continue
            errs = {k: [abs(r["error"][k]) for r in part] for k, _ in METRICS}
            within = sum(r["within"] for r in part)
            out.append(f"{group}, {platform}: {within} of {len(part)} servers within +-10% on all "
                       "three; max |error| " + ", ".join(
                           f"{label.split(' (')[0]} {100 * max(errs[k]):.1f}%"
                           for k, label in METRICS)
                       + "; median |error| " + ", ".join(
                           f"{100 * sorted(errs[k])[len(errs[k]) // 2]:.1f}%" for k, _ in METRICS))
    return out


def write(rows: list[dict[str, Any]], out_dir: Path,
          excluded: tuple[tuple[str, str], ...]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "validation.json"
    md = out_dir / "validation.md"
    payload = {"target": TARGET, "metrics": [k for k, _ in METRICS], "rows": rows,
               "excluded": [{"runs": a, "why": b} for a, b in excluded],
               "summary": summary_lines(rows)}
    js.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    md.write_text("# Scale model: validation against every measured rollout\n\n"
                  "Measured: median over the call's replays; model: one replay of the same trace "
                  "(`python -m benchmarks.scale validate`). Bold: outside +-10%.\n\n"
                  + markdown(rows) + "\n\n" + "\n".join(f"- {s}" for s in summary_lines(rows))
                  + "\n\nLeft out:\n" + "\n".join(f"- {a}: {b}" for a, b in excluded) + "\n")
    return [md, js]


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)
