"""Validation: the model replays every measured rollout in `benchmarks/results/` that has a trace
and a result, and its makespan, p99 TTFT and TPOT p50 are set against the measured medians.

Each row of `RUNS` names one server of one comparison call (its `report.json`), the engine it ran
as the model sees it (the lane's settings of the time: `max_p_inflight` was 4 until the change of
its default on 2026-12-01, after the `w01f`-`w01h` calls, and 16 since), the profile of its
device and model, its layout and client
wait scale. Nothing here is fitted per run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ainfer_pd.rollout.scale.costs import Layout
from vllm_ainfer_pd.rollout.scale.engines import EngineSpec
from vllm_ainfer_pd.rollout.scale.profile import Profile, load_profile
from vllm_ainfer_pd.rollout.scale.sim import simulate
from vllm_ainfer_pd.rollout.trace import Trace, load_trace

METRICS = (("makespan_s", "makespan (s)"), ("ttft_s.p99", "p99 TTFT (s)"),
           ("tpot_s.p50", "TPOT p50 (ms)"))
TARGET = 0.10
PROFILES = {"gpu": "profile_gpu.json", "gpu-mla": "profile_gpu_mla.json",
            "cpu": "profile_cpu_tiny.json"}

OLD = (("max_p_inflight", 4),)  # the lane's default before its 2026-12-01 change
LANE64 = (("p_lane_min_tokens", 64),)


@dataclass(frozen=True)
class Run:
    call: str  # the report's folder under benchmarks/results/
    backend: str  # its name in that report
    engine: EngineSpec
    profile: str  # key of PROFILES
    layout: Layout = field(default_factory=Layout)
    group: str = "main"  # "main": stock / normal / pd as shipped; "variant": other lane settings
    note: str = ""


def _pd(*lane: tuple[str, object], group: str = "main", note: str = "") -> dict[str, Any]:
    return {"engine": EngineSpec("pd", lane=tuple(lane)), "group": group, "note": note}


_STOCK = {"engine": EngineSpec("stock")}
_NORMAL = {"engine": EngineSpec("normal")}
_DP2 = Layout(dp=2, ep=True)
_CPU4 = Layout(dp=2, tp=2, ep=True)

RUNS: tuple[Run, ...] = (
    # 1 x H200, `gpu` preset, client waits x 0.5 (second GPU call of 2026-12-01)
    Run("gpu/rollout_tp1_concurrent/bench1a", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_concurrent/bench1a", "normal", profile="gpu", **_NORMAL),
    Run("gpu/rollout_tp1_concurrent/bench1b", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_concurrent/bench1b", "pd_handoff", profile="gpu",
        **_pd(*OLD, ("d_host_slack_s", 0.0), group="variant",
              note="p_host=handoff: D's thread waits for all of P's host work")),
    Run("gpu/rollout_tp1_concurrent/bench1c", "pd_genq", profile="gpu",
        **_pd(*OLD, ("ordering", "global-enqueue"), group="variant")),
    Run("gpu/rollout_tp1_concurrent/bench1c", "pd_gcomp", profile="gpu",
        **_pd(*OLD, ("ordering", "global-complete"), group="variant")),
    # the earliest GPU rollout (P ran eagerly then; its pd is left out, see docs/scale-model.md)
    Run("gpu/rollout_tp1/run1_stock_normal_pd_failedP", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1/run1_stock_normal_pd_failedP", "normal", profile="gpu",
        engine=EngineSpec("normal", async_scheduling=False),
        note="the backend then ran vLLM's synchronous scheduler"),
    # 1 x H200, `gpu` preset, client waits x 0.1
    Run("gpu/rollout_tp1_w01/bench1x_w01a", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01a", "normal", profile="gpu", **_NORMAL),
    Run("gpu/rollout_tp1_w01/bench1x_w01a", "pd", profile="gpu", **_pd(*OLD, note="1 replay")),
    Run("gpu/rollout_tp1_w01/bench1x_w01b", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_w01/bench1x_w01b", "pd_whole", profile="gpu",
        **_pd(*OLD, ("segment_policy", "fixed"), ("segment_span", 64), group="variant")),
    Run("gpu/rollout_tp1_w01/bench1x_w01c", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01c", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_w01/bench1x_w01d", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01d", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_w01/bench1x_w01d", "pd_work", profile="gpu",
        **_pd(*OLD, ("segment_policy", "work"), group="variant")),
    Run("gpu/rollout_tp1_w01/bench1x_w01e", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01e", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_w01/bench1x_w01f", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01f", "pd", profile="gpu", **_pd(*OLD)),
    Run("gpu/rollout_tp1_w01/bench1x_w01f", "pd_inflight16", profile="gpu", **_pd()),
    Run("gpu/rollout_tp1_w01/bench1x_w01g", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01g", "pd_inflight16", profile="gpu", **_pd()),
    Run("gpu/rollout_tp1_w01/bench1x_w01g", "pd_lane2k", profile="gpu",
        **_pd(*OLD, ("p_lane_min_tokens", 2048), group="variant")),
    Run("gpu/rollout_tp1_w01/bench1x_w01h", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01h", "pd_inflight8", profile="gpu",
        **_pd(("max_p_inflight", 8), group="variant")),
    Run("gpu/rollout_tp1_w01/bench1x_w01j", "stock", profile="gpu", **_STOCK),
    Run("gpu/rollout_tp1_w01/bench1x_w01j", "pd", profile="gpu", **_pd()),
    Run("gpu/rollout_tp1_w01/bench1x_w01j", "pd_dhigh", profile="gpu",
        **_pd(group="variant", note="d_stream_priority=high: modelled as pd")),
    Run("gpu/rollout_tp1_w01/bench1x_w01k", "pd", profile="gpu", **_pd()),
    Run("gpu/rollout_tp1_w01/bench1x_w01k", "pd_genq", profile="gpu",
        **_pd(("ordering", "global-enqueue"), group="variant")),
    # 1 x H200, `gpu-mla` preset, client waits x 0.1
    Run("gpu/rollout_tp1_mla/bench1xmla_a", "stock", profile="gpu-mla", **_STOCK),
    Run("gpu/rollout_tp1_mla/bench1xmla_a", "pd", profile="gpu-mla", **_pd()),
    Run("gpu/rollout_tp1_mla/bench1xmla_b", "stock", profile="gpu-mla", **_STOCK),
    Run("gpu/rollout_tp1_mla/bench1xmla_b", "pd", profile="gpu-mla", **_pd()),
    Run("gpu/rollout_tp1_mla/bench1xmla_c", "normal", profile="gpu-mla", **_NORMAL),
    Run("gpu/rollout_tp1_mla/bench1xmla_c", "pd_genq", profile="gpu-mla",
        **_pd(("ordering", "global-enqueue"), group="variant")),
    Run("gpu/rollout_tp1_mla/bench1xmla_d", "stock", profile="gpu-mla", **_STOCK),
    Run("gpu/rollout_tp1_mla/bench1xmla_d", "pd", profile="gpu-mla", **_pd()),
    # 2 x H200, DP=2 + EP, `gpu` preset, client waits x 0.5
    Run("gpu/rollout_dp2_ep/bench2dp_a", "stock", profile="gpu", layout=_DP2, **_STOCK),
    Run("gpu/rollout_dp2_ep/bench2dp_a", "normal", profile="gpu", layout=_DP2, **_NORMAL),
    # 1 x H200, decode only (64 one-turn requests): also a calibration point of the profile
    Run("gpu/decode_only_gpu_preset/decodeg_a", "stock", profile="gpu", **_STOCK,
        group="calibration"),
    Run("gpu/decode_only_gpu_preset/decodeg_a", "pd", profile="gpu", **_pd(group="calibration")),
    Run("gpu/decode_only_gpu_preset/decodeg_b", "stock", profile="gpu", **_STOCK,
        group="calibration"),
    Run("gpu/decode_only_gpu_preset/decodeg_b", "pd", profile="gpu", **_pd(group="calibration")),
    # CPU (2 cores, tiny model), `cpu` trace preset
    Run("cpu/rollout", "stock", profile="cpu", **_STOCK),
    Run("cpu/rollout", "ainfer_pd", profile="cpu", **_pd()),
    Run("cpu/rollout", "ainfer_pd_lane64", profile="cpu", **_pd(*LANE64, group="variant")),
    Run("cpu/ladder", "stock", profile="cpu", **_STOCK),
    Run("cpu/ladder", "normal", profile="cpu", **_NORMAL),
    Run("cpu/ladder", "ainfer_pd", profile="cpu", **_pd(*OLD)),
    Run("cpu/ladder", "fine", profile="cpu", **_pd(*OLD, *LANE64, group="variant")),
    Run("cpu/ladder", "global-enqueue", profile="cpu",
        **_pd(*OLD, *LANE64, ("ordering", "global-enqueue"), group="variant")),
    Run("cpu/rollout_tp2_dp2_ep", "normal", profile="cpu", layout=_CPU4, **_NORMAL),
    Run("cpu/rollout_tp2_dp2_ep", "pd_lane64", profile="cpu", layout=_CPU4,
        **_pd(*LANE64, group="variant")),
)

EXCLUDED = (
    ("gpu/rollout_tp1/run1_stock_normal_pd_failedP pd, gpu/rollout_tp1/run2_pd pd",
     ("the earliest GPU rollout's lane ran P eagerly, op by op, and in run1 every P epoch failed "
      "and recomputed inline: an implementation the model does not describe")),
    ("gpu/rollout_dp2_ep/bench2dp_b_failed pd, pd_genq",
     "no request completed (the DP metadata bug fixed since)"),
    ("gpu/rollout_tp1_w01/bench1x_w01i", "its report.json did not come back (only the log)"),
    ("gpu/*/merged", "merges of the calls above (each call is validated once)"),
)


def results_root() -> Path:
    return Path(__file__).resolve().parents[3] / "benchmarks" / "results"


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


def validate(root: Path | None = None, profiles_dir: Path | None = None,
             runs: tuple[Run, ...] = RUNS) -> list[dict[str, Any]]:
    root = root or results_root()
    profiles_dir = profiles_dir or root / "scale"
    loaded: dict[str, Profile] = {}
    rows = []
    for run in runs:
        folder = root / run.call
        report = json.loads((folder / "report.json").read_text())
        prof = loaded.get(run.profile) or load_profile(profiles_dir / PROFILES[run.profile])
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


def write(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "validation.json"
    md = out_dir / "validation.md"
    payload = {"target": TARGET, "metrics": [k for k, _ in METRICS], "rows": rows,
               "excluded": [{"runs": a, "why": b} for a, b in EXCLUDED],
               "summary": summary_lines(rows)}
    js.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    md.write_text("# Scale model: validation against every measured rollout\n\n"
                  "Measured: median over the call's replays; model: one replay of the same trace "
                  "(`vllm-ainfer-pd-rollout project validate`). Bold: outside +-10%.\n\n"
                  + markdown(rows) + "\n\n" + "\n".join(f"- {s}" for s in summary_lines(rows))
                  + "\n\nLeft out:\n" + "\n".join(f"- {a}: {b}" for a, b in EXCLUDED) + "\n")
    return [md, js]


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)
