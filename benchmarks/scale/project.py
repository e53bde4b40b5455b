"""Projections: DP = 1, 2, 4, 8, 16 with expert parallelism, the same load on every rank (the trace
repeated once per DP rank), for the `gpu` and `gpu-mla` presets and a DeepSeek-V3-sized model,
and the paper's own setting. Every number here is a projection, labelled so.

Each row runs every engine on the traces of `SEEDS` (the generator's seed) and reports the
median over them with the range; vLLM's prefill cadence is swept over `CADENCES` and its best N
taken per seed. `pd` is the lane's defaults (at DP > 1 the epoch gate on, every prompt through
the lane); `pd_nogate` the defaults before the gate (`NO_GATE`: it opened an epoch as soon as any
rank had lane work, prompts under 512 uncached tokens inline); `pd_lane_c` the defaults with the
`contention` the lane measured (`lane_contention`) in place of the profile's, fitted to the TP=1
rollouts (1.0: D pays all of P's device time it overlaps).

A DeepSeek-V3-sized profile is derived from the measured `gpu-mla` profile by FLOP and byte
scaling: DeepSeek-V3's shape (61 layers, 3 dense, 256 routed experts top-8 with one shared,
hidden 7,168, MLA with 128 heads, FP8 weights, bf16 KV), uniform routing (a trained router with
load balancing, where the dummy-weight `gpu-mla` routes to a few experts), the H200's fitted byte
and FLOP rates (FP8 GEMMs at the measured bf16 rate: no FP8 speed-up is assumed), the per-step
constant and the host floors of graph modes scaled by layers (61 / 24), the lane's host time per
layer as measured on `gpu-mla`. Its weights (~671 GB in FP8) fit in 141 GB H200s only from EP=8
(84 GB each, leaving ~45 GB for KV); smaller layouts are left out.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.scale.costs import Layout
from benchmarks.scale.engines import EngineSpec
from benchmarks.scale.profile import Costs, Profile, load_profile
from benchmarks.scale.shape import ModelShape
from benchmarks.scale.sim import simulate
from vllm_ainfer_pd.config import AInferPDConfig
from vllm_ainfer_pd.rollout.generator import generate
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory

DPS = (1, 2, 4, 8, 16)
CADENCES = (2, 4, 8, 16, 32, 64, 128, 256)
SEEDS = (0, 1, 2)
LABEL = "projected"
# The lane's defaults before the epoch gate (gpu_run.sh's pd_nogate, with the threshold it had).
NO_GATE = (("epoch_gate_fill", 0.0), ("p_lane_min_tokens", 512))
VARIANTS = ("pd", "pd_nogate", "pd_lane_c")
# D and P beside each other in the real lane, relative to each alone (benchmarks/lane_contention.py,
# the shipped `p_stream_marks`, the `gpu` preset on one H100).
LANE_CONTENTION = (Path(__file__).resolve().parents[1]
                   / "results/gpu/lane_contention_h100/segment.json")

DEEPSEEK_V3 = ModelShape(
    name="deepseek-v3", hidden=7168, layers=61, heads=128, vocab=129280, experts=256, top_k=8,
    moe_inter=2048, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, shared_experts=1, dense_layers=3, dense_inter=18432,
    weight_bytes=1.0, kv_bytes=2.0, act_bytes=2.0)
H200_GB = 141.0


def scaled_profile(base: Profile, shape: ModelShape, name: str, *, flops: float = 1.0,
                   bytes_: float = 1.0, hardware: dict[str, Any] | None = None) -> Profile:
    """`base`'s device and host constants carried to `shape`: per-layer host work and the
    per-step constant scale with the layer count; `flops` and `bytes_` divide the rates (another
    device's peaks over the measured one's)."""
    c = base.costs
    layers = shape.layers / base.shape.layers
    fixed = Costs(c.t0 * layers, c.s_per_byte / bytes_, c.s_per_flop / flops,
                  c.s_per_attn_flop / flops, c.h_piecewise * layers, c.h_eager * layers)
    return replace(base, name=name, shape=shape, points=(), fixed_costs=fixed,
                   hardware={**base.hardware, **(hardware or {})},
                   source=f"{LABEL}: {name} scaled from {base.name} ({base.source[:80]}...)")


def weights_fit(shape: ModelShape, ranks: int, gpu_gb: float = H200_GB) -> bool:
    """Whether a rank's share of the weights leaves at least a fifth of the GPU for KV."""
    per_rank = (shape.dense_params + shape.moe_layers * shape.experts * shape.expert_params
                / ranks) * shape.weight_bytes / 1e9
    return per_rank <= 0.8 * gpu_gb


def replicate(trace: Trace, copies: int) -> Trace:
    """`copies` copies of every trajectory (new ids): the load of one rank on each of `copies`."""
    if copies == 1:
        return trace
    trajs = tuple(Trajectory(f"{t.id}.{k}", t.turns, t.start_s)
                  for k in range(copies) for t in trace.trajectories)
    return Trace(trajs, {**trace.meta, "replicated": copies})


def _metrics(summary: dict[str, Any]) -> dict[str, float]:
    return {"makespan_s": summary["makespan_s"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "requests_per_s": summary["requests_per_s"]}


@functools.cache
def lane_contention(path: Path = LANE_CONTENTION, pattern: str = "segment") -> float:
    """The model's `contention` that charges D what the lane measurement saw. Beside P, D ran at
    `d` of its rate alone and P at `p` of its own, so D paid (1 - d) / p of each second of P's
    device time; the model charges (1 - e) + contention x e, with `e` the share of P's device
    time D overlapped (the same run's CUDA events). Median over the repetitions."""
    reps = [r["rates"] for r in json.loads(path.read_text())["results"][pattern]["reps"]]
    return max(0.0, statistics.median(
        ((1 - r["d_beside"]) / r["p_beside"] - (1 - r["p_device_overlapped"]))
        / r["p_device_overlapped"] for r in reps))


def engine_specs(dp: int, cadences: tuple[int, ...] = CADENCES) -> dict[str, EngineSpec]:
    specs = {"stock": EngineSpec("stock"), "normal": EngineSpec("normal"),
             "pd": EngineSpec("pd"), "pd_nogate": EngineSpec("pd", lane=NO_GATE),
             "pd_lane_c": EngineSpec("pd", lane=(("contention", lane_contention()),))}
    specs.update({f"cadence{n}": EngineSpec("cadence", cadence=n) for n in cadences if dp > 1})
    return specs


def project_one(profile: Profile, work: Trace, dp: int, wait_scale: float,
                cadences: tuple[int, ...] = CADENCES) -> dict[str, Any]:
    """Every engine on `dp` ranks (expert parallelism over all of them) replaying `work`; the
    best cadence is the one with the shortest makespan (stock where none is shorter)."""
    layout = Layout(dp=dp, ep=True)
    out: dict[str, Any] = {"dp": dp, "label": LABEL, "engines": {}, "lane": {}}
    for label, spec in engine_specs(dp, cadences).items():
        res = simulate(work, profile, layout, spec, wait_scale)
        out["engines"][label] = _metrics(res.summary)
        if spec.kind == "pd":
            c = res.counters
            out["lane"][label] = {
                "epochs": c["epochs"], "gate_waits": c["gate_waits"],
                "p_tokens_per_epoch": c["lane_tokens"] / max(1, c["epochs"]),
                "rank_utilisation": c["lane_tokens"] / max(1, c["epoch_rank_tokens"])}
    eng = out["engines"]
    cads = {k: v for k, v in eng.items() if k.startswith("cadence")} or {"stock": eng["stock"]}
    best = min(cads, key=lambda k: cads[k]["makespan_s"])
    if eng["stock"]["makespan_s"] <= cads[best]["makespan_s"]:
        best = "stock"
    out["best_cadence"] = best
    out["ratios"] = {}
    for v in VARIANTS:
        for base in ("stock", "best_cadence", "normal"):
            ref = eng[best] if base == "best_cadence" else eng[base]
            out["ratios"][f"{v}/{base}"] = {k: eng[v][k] / ref[k] for k in eng[v]}
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over seeds of every engine's metrics and every ratio, and each ratio's range."""
    first = per_seed[0]
    engines = {e: {k: _median([r["engines"][e][k] for r in per_seed]) for k in m}
               for e, m in first["engines"].items()}
    ratios = {q: {k: _median([r["ratios"][q][k] for r in per_seed]) for k in m}
              for q, m in first["ratios"].items()}
    ranges = {q: {k: [min(r["ratios"][q][k] for r in per_seed),
                      max(r["ratios"][q][k] for r in per_seed)] for k in m}
              for q, m in first["ratios"].items()}
    lane = {e: {k: _median([r["lane"][e][k] for r in per_seed]) for k in m}
            for e, m in first["lane"].items()}
    return {"engines": engines, "ratios": ratios, "ranges": ranges, "lane": lane,
            "best_cadence": [r["best_cadence"] for r in per_seed],
            "best_cadence_makespan_s": _median([r["engines"][r["best_cadence"]]["makespan_s"]
                                                for r in per_seed])}


def load(name: str, dp: int, trace: Trace, paper: Trace,
         trace_preset: str = "gpu-quick") -> tuple[Trace, str]:
    """The work `dp` ranks replay for preset `name`, and its label: `trace` once per rank; for
    the DeepSeek-V3-sized model the paper's trace (128 trajectories) per 8 ranks, 16 per rank,
    since the `gpu-quick` load (64 per rank) saturates its prefill."""
    if name == "deepseek-v3":
        copies = max(1, dp // 8)
        return replicate(paper, copies), f"paper x {copies}"
    return replicate(trace, dp), f"{trace_preset} x {dp}"


def project(profiles: dict[str, Profile], trace_preset: str = "gpu-quick",
            wait_scale: float = 0.1, dps: tuple[int, ...] = DPS,
            progress: Any = None, seeds: tuple[int, ...] = SEEDS) -> list[dict[str, Any]]:
    traces = {seed: (generate(trace_preset, seed), generate("paper", seed)) for seed in seeds}
    rows = []
    for name, prof in profiles.items():
        for dp in dps:
            if not weights_fit(prof.shape, dp):
                rows.append({"preset": name, "dp": dp, "label": LABEL, "skipped":
                             "weights do not fit in this many H200s"})
                continue
            per_seed, label = [], ""
            for seed in seeds:
                work, label = load(name, dp, *traces[seed], trace_preset)
                per_seed.append({"seed": seed, **project_one(prof, work, dp, wait_scale)})
            row = {"preset": name, "dp": dp, "trace": label, "wait_scale": wait_scale,
                   "label": LABEL, "seeds": list(seeds), **aggregate(per_seed),
                   "per_seed": per_seed}
            rows.append(row)
            if progress:
                progress(row)
    return rows


def default_profiles(scale_dir: Path) -> dict[str, Profile]:
    gpu = load_profile(scale_dir / "profile_gpu.json")
    mla = load_profile(scale_dir / "profile_gpu_mla.json")
    dsv3 = scaled_profile(mla, DEEPSEEK_V3, "deepseek-v3")
    return {"gpu": gpu, "gpu-mla": mla, "deepseek-v3": dsv3}


# -- the epoch gate's defaults ---------------------------------------------------------------

GATE_FILLS = (0.5, 0.65, 0.8, 0.9)
GATE_ROUNDS = (32, 64, 96, 128)
GATE_THRESHOLDS = (512, 2)
GATE_ROWS = (("gpu", 2), ("gpu", 4), ("gpu", 8), ("deepseek-v3", 8))


def gate_sweep(profiles: dict[str, Profile], seeds: tuple[int, ...] = SEEDS,
               rows: tuple[tuple[str, int], ...] = GATE_ROWS,
               wait_scale: float = 0.1) -> list[dict[str, Any]]:
    """The gate's fill x deadline x the lane's threshold, each against the best cadence and stock
    on the traces of `seeds` (medians): how the defaults were chosen. Same loads as `project`."""
    out = []
    for name, dp in rows:
        prof, layout = profiles[name], Layout(dp=dp, ep=True)
        per_setting: dict[tuple, list[dict[str, float]]] = {}
        for seed in seeds:
            work, _ = load(name, dp, generate("gpu-quick", seed), generate("paper", seed))
            stock = simulate(work, prof, layout, EngineSpec("stock"), wait_scale).summary
            best = min([stock["makespan_s"]] + [
                simulate(work, prof, layout, EngineSpec("cadence", cadence=n),
                         wait_scale).summary["makespan_s"] for n in CADENCES])
            for fill in GATE_FILLS:
                for rounds in GATE_ROUNDS:
                    for threshold in GATE_THRESHOLDS:
                        lane = (("epoch_gate_fill", fill), ("epoch_gate_rounds", rounds),
                                ("p_lane_min_tokens", threshold))
                        sm = simulate(work, prof, layout, EngineSpec("pd", lane=lane),
                                      wait_scale).summary
                        per_setting.setdefault((fill, rounds, threshold), []).append({
                            "makespan/best_cadence": sm["makespan_s"] / best,
                            "ttft_p50/stock": sm["ttft_s"]["p50"] / stock["ttft_s"]["p50"],
                            "ttft_p99/stock": sm["ttft_s"]["p99"] / stock["ttft_s"]["p99"]})
        for (fill, rounds, threshold), vals in per_setting.items():
            out.append({"preset": name, "dp": dp, "label": LABEL, "epoch_gate_fill": fill,
                        "epoch_gate_rounds": rounds, "p_lane_min_tokens": threshold,
                        **{k: _median([v[k] for v in vals]) for k in vals[0]}})
    return out


def gate_sweep_markdown(rows: list[dict[str, Any]]) -> str:
    product = AInferPDConfig()
    defaults = (product.epoch_gate_fill, product.epoch_gate_rounds, product.lane_min_tokens(2))
    lines = [f"All numbers {LABEL}: medians over trace seeds {', '.join(map(str, SEEDS))}; per "
             "row, settings best first. The lane's defaults at DP > 1 (fill "
             f"{defaults[0]:g}, {defaults[1]} rounds, threshold {defaults[2]}) are in bold.", ""]
    for key in dict.fromkeys((r["preset"], r["dp"]) for r in rows):
        lines += [f"### {key[0]}, DP={key[1]}", "",
                  "| fill | deadline (rounds) | threshold (tokens) | makespan / best cadence "
                  "| TTFT p50 / stock | TTFT p99 / stock |", "|---|---|---|---|---|---|"]
        sel = sorted((r for r in rows if (r["preset"], r["dp"]) == key),
                     key=lambda r: r["makespan/best_cadence"])
        for r in sel:
            cells = [f"{r['epoch_gate_fill']:g}", str(r["epoch_gate_rounds"]),
                     str(r["p_lane_min_tokens"]), f"{r['makespan/best_cadence']:.3f}",
                     f"{r['ttft_p50/stock']:.2f}", f"{r['ttft_p99/stock']:.2f}"]
            if (r["epoch_gate_fill"], r["epoch_gate_rounds"], r["p_lane_min_tokens"]) == defaults:
                cells = [f"**{c}**" for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# -- what prefill costs at all ----------------------------------------------------------------

BOUND_ROWS = (("gpu", 1), ("gpu-mla", 1))


def prefill_bounds(profiles: dict[str, Profile], seeds: tuple[int, ...] = SEEDS,
                   rows: tuple[tuple[str, int], ...] = BOUND_ROWS,
                   wait_scale: float = 0.1) -> list[dict[str, Any]]:
    """Stock with the prefix cache holding every later turn's prompt (`later`: the first turns'
    burst costs what it costs, the later turns' prefill next to nothing) and every prompt
    (`all`: `rollout compare --cached-replay`'s second replay), beside `pd` and `pd` at the
    lane's measured contention, each over stock cold (makespan medians and ranges over `seeds`):
    how far any way of running prefill beside the same decode could take the rollout."""
    out = []
    for name, dp in rows:
        prof, layout = profiles[name], Layout(dp=dp, ep=dp > 1)
        ratios: dict[str, list[float]] = {}
        for seed in seeds:
            work, _ = load(name, dp, generate("gpu-quick", seed), generate("paper", seed))
            runs = {
                "pd": simulate(work, prof, layout, EngineSpec("pd"), wait_scale),
                "pd_lane_c": simulate(work, prof, layout, engine_specs(dp)["pd_lane_c"],
                                      wait_scale),
                "stock_later_cached": simulate(work, prof, layout, EngineSpec("stock"),
                                               wait_scale, cached="later"),
                "stock_cached": simulate(work, prof, layout, EngineSpec("stock"), wait_scale,
                                         cached="all")}
            stock = simulate(work, prof, layout, EngineSpec("stock"), wait_scale)
            for k, r in runs.items():
                ratios.setdefault(k, []).append(
                    r.summary["makespan_s"] / stock.summary["makespan_s"])
            ratios.setdefault("stock_makespan_s", []).append(stock.summary["makespan_s"])
        out.append({"preset": name, "dp": dp, "label": LABEL,
                    **{k: {"median": _median(v), "min": min(v), "max": max(v)}
                       for k, v in ratios.items()}})
    return out


def prefill_bounds_markdown(rows: list[dict[str, Any]]) -> str:
    cols = (("pd", "`pd`"),
            ("pd_lane_c", f"`pd` at the lane's contention ({lane_contention():.2f})"),
            ("stock_later_cached", "stock, later turns cached"),
            ("stock_cached", "stock, every prompt cached"))
    lines = [f"All numbers {LABEL}: makespan over stock's cold replay, median [range] over trace "
             f"seeds {', '.join(map(str, SEEDS))} (`gpu-quick`, waits x 0.1).", "",
             "| row | stock (s) | " + " | ".join(c for _, c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r['preset']} DP={r['dp']}", f"{r['stock_makespan_s']['median']:.2f}"]
        cells += [f"{r[k]['median']:.3f} [{r[k]['min']:.3f}, {r[k]['max']:.3f}]" for k, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- the paper's setting ---------------------------------------------------------------------

# Its main campaign: 8 x H20-3E, EP8 / ADP8 (H3, H4: attention TP 1), a 42-layer MoE with hidden
# 2,560, 512 routed experts, top-8; the `paper` trace (128 trajectories, 1,265 requests), client
# waits x 0, 0.01, 0.03, 0.10 (P1-P4) and the original vector. What the paper does not state is
# assumed: GQA attention with 32 heads of 128 and 4 KV heads, 1,536-wide experts, no shared or
# dense layers, vocabulary 151,936, bf16; H20-3E at 148 TFLOP/s (bf16 dense) and 4.8 TB/s, the
# H200's measured efficiencies carried over by those peaks, NVLink within the node.
PAPER_SHAPE = ModelShape(name="paper-42l", hidden=2560, layers=42, heads=32, vocab=151936,
                         experts=512, top_k=8, moe_inter=1536, attention="gqa", kv_heads=4,
                         head_dim=128)
H20_3E = {"name": "H20-3E", "peak_tflops": 148.0, "hbm_tbps": 4.8}
PAPER_WAITS = {"P1": 0.0, "P2": 0.01, "P3": 0.03, "P4": 0.10, "original": 1.0}
# The paper's reported AInfer-PD against Normal on this setting (section 7): requests/s gains of
# 22.0-34.6% over P1-P4 with DeepEP (makespan 0.74-0.82x), 5.5% lower makespan with the original
# waits; without DeepEP on H3/H4, E2E -21.5% and -22.5% with no added wait.
PAPER_REPORTED = {"P1-P4 (DeepEP)": "makespan 0.74-0.82x Normal (requests/s +22.0-34.6%)",
                  "original waits": "makespan 0.945x Normal", "H3/H4, no wait": "E2E 0.775-0.785x"}


def paper_profile(gpu: Profile) -> Profile:
    hw = {"peak_tflops": H20_3E["peak_tflops"], "hbm_tbps": H20_3E["hbm_tbps"],
          "name": H20_3E["name"]}
    return scaled_profile(gpu, PAPER_SHAPE, "paper-42l-h20",
                          flops=H20_3E["peak_tflops"] / gpu.hardware["peak_tflops"],
                          bytes_=H20_3E["hbm_tbps"] / gpu.hardware["hbm_tbps"], hardware=hw)


def project_paper(gpu: Profile, dp: int = 8) -> list[dict[str, Any]]:
    prof = paper_profile(gpu)
    trace = generate("paper", 0)
    rows = []
    for name, ws in PAPER_WAITS.items():
        layout = Layout(dp=dp, ep=True)
        eng = {}
        for spec in (EngineSpec("stock"), EngineSpec("normal"), EngineSpec("pd")):
            eng[spec.label] = _metrics(simulate(trace, prof, layout, spec, ws).summary)
        rows.append({"setting": name, "wait_scale": ws, "dp": dp, "label": LABEL,
                     "engines": eng,
                     "pd/normal": {k: eng["pd"][k] / eng["normal"][k] for k in eng["pd"]}})
    return rows


# -- output ----------------------------------------------------------------------------------

def markdown(rows: list[dict[str, Any]]) -> str:
    seeds = next((r["seeds"] for r in rows if "seeds" in r), [])
    head = ("| preset | DP (=EP) | trace | stock makespan (s) | best cadence, per seed "
            "| pd_nogate / best cadence: makespan "
            "| pd / stock: makespan, p99 TTFT, TPOT p50 "
            "| pd / best cadence: makespan [range] | pd / best cadence: p99 TTFT "
            f"| pd at the lane's contention ({lane_contention():.2f}) / best cadence: "
            "makespan, p99 TTFT |")
    lines = [f"All numbers {LABEL}: medians over trace seeds {', '.join(map(str, seeds))} "
             f"(range in brackets); cadence N = {', '.join(map(str, CADENCES))}.", "", head,
             "|" + "---|" * 11]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['preset']} | {r['dp']} | {r['skipped']} |" + " |" * 8)
            continue
        e, q, rg = r["engines"], r["ratios"], r["ranges"]
        best = ", ".join(c.replace("cadence", "N=") for c in r["best_cadence"])
        g = q["pd/best_cadence"]["makespan_s"]
        lo, hi = rg["pd/best_cadence"]["makespan_s"]
        lines.append(
            f"| {r['preset']} | {r['dp']} | {r['trace']} | {e['stock']['makespan_s']:.1f} | "
            f"{best} ({r['best_cadence_makespan_s']:.1f} s) | "
            f"{q['pd_nogate/best_cadence']['makespan_s']:.3f} | "
            f"{q['pd/stock']['makespan_s']:.3f}, {q['pd/stock']['ttft_p99_s']:.2f}, "
            f"{q['pd/stock']['tpot_p50_s']:.2f} | **{g:.3f}** [{lo:.3f}, {hi:.3f}] | "
            f"{q['pd/best_cadence']['ttft_p99_s']:.2f} | "
            f"{q['pd_lane_c/best_cadence']['makespan_s']:.3f}, "
            f"{q['pd_lane_c/best_cadence']['ttft_p99_s']:.2f} |")
    lines += ["", "The lane in the model (medians over seeds): epochs, P tokens per epoch, and "
              "rank utilisation (an epoch's tokens over ranks x its fullest rank's tokens):", "",
              "| preset | DP | pd_nogate: epochs, tokens / epoch, utilisation "
              "| pd: epochs, tokens / epoch, utilisation, rounds the gate waited |",
              "|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            continue
        a, b = r["lane"]["pd_nogate"], r["lane"]["pd"]
        lines.append(f"| {r['preset']} | {r['dp']} | {a['epochs']:.0f}, "
                     f"{a['p_tokens_per_epoch']:.0f}, {a['rank_utilisation']:.2f} | "
                     f"{b['epochs']:.0f}, {b['p_tokens_per_epoch']:.0f}, "
                     f"{b['rank_utilisation']:.2f}, {b['gate_waits']:.0f} |")
    return "\n".join(lines)


def paper_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| waits | stock makespan (s) | normal makespan (s) | pd makespan (s) | "
            "pd / normal: makespan, p99 TTFT |")
    lines = [f"All model numbers {LABEL} (8 x H20-3E, EP8 / ADP8, `paper` trace).", "", head,
             "|---|---|---|---|---|"]
    for r in rows:
        e, q = r["engines"], r["pd/normal"]
        lines.append(f"| {r['setting']} (x {r['wait_scale']:g}) | {e['stock']['makespan_s']:.1f} "
                     f"| {e['normal']['makespan_s']:.1f} | {e['pd']['makespan_s']:.1f} | "
                     f"{q['makespan_s']:.3f}, {q['ttft_p99_s']:.2f} |")
    lines += ["", ("The paper reports (measured, its own engine AInfer, against AInfer Normal, "
                   "which gives prefill strict priority):")]
    lines += [f"- {k}: {v}" for k, v in PAPER_REPORTED.items()]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in ((axes[0], "pd_nogate/best_cadence", "pd, gate off / best cadence"),
                           (axes[1], "pd/best_cadence", "pd / best cadence")):
        for preset in dict.fromkeys(r["preset"] for r in rows):
            pts = [(r["dp"], r["ratios"][key]["makespan_s"]) for r in rows
                   if r["preset"] == preset and "ratios" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=preset)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DP ranks (expert parallelism over all)")
        ax.set_title(f"{title} ({LABEL})")
    axes[0].set_ylabel("makespan ratio")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(rows: list[dict[str, Any]], paper: list[dict[str, Any]], out_dir: Path,
          meta: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "projection.json", out_dir / "projection.md"
    js.write_text(json.dumps({"label": LABEL, "meta": meta, "rows": rows, "paper": paper},
                             indent=1, default=_nan) + "\n")
    md.write_text("# Scale model: projections\n\n" + markdown(rows)
                  + "\n\n## The paper's setting\n\n" + paper_markdown(paper) + "\n")
    paths = [md, js]
    png = plot(rows, out_dir / "projection.png")
    if png:
        paths.append(png)
    return paths


def _nan(x: Any) -> Any:
    return None if isinstance(x, float) and math.isnan(x) else str(x)
