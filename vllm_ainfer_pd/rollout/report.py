"""Comparison report: report.json (everything), report.md (median [IQR] table with ratios against
the first backend, normally stock vLLM) and PNG plots (request/trajectory completion CCDFs,
makespan bars with IQR whiskers).

A run is a dict {"backend", "rep", "summary" (metrics.summarize), "counters"
(backend_metrics.delta), "request_completion_s", "trajectory_completion_s" (the samples)}.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vllm_ainfer_pd.rollout.backend_metrics import BY_SOURCE, PREFIX
from vllm_ainfer_pd.rollout.metrics import quantile

# Where each prompt token came from: (row label, counter). vLLM counts what the P lane prefilled as
# tokens arriving through the KV connector, so they sit in `external_kv_transfer` and inside
# `vllm:prompt_tokens_cached_total`: only `local_cache_hit` is prefix-cache reuse.
PROMPT_SOURCES = [
    ("prompt tokens", "vllm:prompt_tokens_total"),
    ("computed inline (D's steps)", BY_SOURCE + '{source="local_compute"}'),
    ("prefix-cache hits", BY_SOURCE + '{source="local_cache_hit"}'),
    ("prefilled by the P lane", BY_SOURCE + '{source="external_kv_transfer"}'),
    ("vLLM's `cached` (prefix-cache hits + P lane)", "vllm:prompt_tokens_cached_total"),
]

# (summary key path, label, display scale). Every metric is lower-is-better except requests/s.
METRICS = [
    ("makespan_s", "makespan (s)", 1.0),
    ("requests_per_s", "completed requests/s (higher is better)", 1.0),
    ("request_completion_s.p50", "request completion p50 (s)", 1.0),
    ("request_completion_s.p99", "request completion p99 (s)", 1.0),
    ("trajectory_completion_s.p50", "trajectory completion p50 (s)", 1.0),
    ("trajectory_completion_s.p99", "trajectory completion p99 (s)", 1.0),
    ("ttft_s.p50", "TTFT p50 (s)", 1.0),
    ("ttft_s.p99", "TTFT p99 (s)", 1.0),
    ("tpot_s.p50", "TPOT p50 (ms)", 1000.0),
    ("tpot_s.p99", "TPOT p99 (ms)", 1000.0),
    ("failed", "failed requests", 1.0),
]


def _get(summary: dict, path: str) -> float:
    for part in path.split("."):
        summary = summary[part]
    return math.nan if summary is None else float(summary)  # report.json writes NaN as null


def spread(values: list[float]) -> dict[str, float]:
    """Median and interquartile range (linear-interpolation quartiles) of repetitions."""
    vals = [v for v in values if not math.isnan(v)]
    return {"median": quantile(vals, 0.5), "q1": quantile(vals, 0.25),
            "q3": quantile(vals, 0.75), "n": len(vals)}


def aggregate(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per metric path (METRICS) and per counter name: spread over the runs."""
    out = {path: spread([_get(r["summary"], path) for r in runs]) for path, _, _ in METRICS}
    names = sorted({n for r in runs for n in r["counters"]})
    for name in names:
        out[name] = spread([r["counters"][name] for r in runs if name in r["counters"]])
    return out


def build(meta: dict[str, Any], backends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`backends[name]` = {"args": [...], "runs": [...], "error": str | None}; adds aggregates."""
    for b in backends.values():
        b["aggregate"] = aggregate(b["runs"]) if b["runs"] else {}
    return {"meta": meta, "backends": backends}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs of the same comparison split over devices (`compare --only`):
    backends in the given order (the first report's first backend is the ratios' base), the first
    report's meta plus each part's schedule and backends."""
    backends: dict[str, dict[str, Any]] = {}
    for r in reports:
        for name, b in r["backends"].items():
            if name in backends:
                raise ValueError(f"backend {name!r} appears in more than one report")
            backends[name] = {k: v for k, v in b.items() if k != "aggregate"}
    meta = dict(reports[0]["meta"])
    meta["schedule"] = "; ".join(
        f"part {i} ({', '.join(r['backends'])}): {r['meta'].get('schedule', '?')}"
        for i, r in enumerate(reports))
    return build(meta, backends)


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3
    return f"{x:.{digits}f}"


def _cell(s: dict[str, float] | None, scale: float = 1.0) -> str:
    if not s or not s["n"]:
        return "n/a"
    return f"{_fmt(s['median'] * scale)} [{_fmt(s['q1'] * scale)}, {_fmt(s['q3'] * scale)}]"


def markdown(report: dict[str, Any]) -> str:
    meta, backends = report["meta"], report["backends"]
    names = list(backends)
    base = names[0]
    lines = [f"# Rollout comparison: {', '.join(names)}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    if isinstance(meta.get("trace"), dict):
        lines.append("- trace: " + ", ".join(f"{k}={v}" for k, v in meta["trace"].items()))
    for name, b in backends.items():
        extra = " ".join(b["args"]) or "(no extra flags)"
        status = f" -- FAILED: {b['error']}" if b.get("error") else ""
        lines.append(f"- `{name}`: {len(b['runs'])} run(s), flags `{extra}`{status}")
    lines += ["", f"Median [IQR] over repetitions; ratio = backend median / `{base}` median.", ""]
    head = ["metric", *names, *[f"{n} / {base}" for n in names[1:]]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path, label, scale in METRICS:
        cells = [_cell(backends[n]["aggregate"].get(path), scale) for n in names]
        ratios = []
        b0 = backends[base]["aggregate"].get(path)
        for n in names[1:]:
            bn = backends[n]["aggregate"].get(path)
            ok = b0 and bn and b0["n"] and bn["n"] and b0["median"]
            ratios.append(f"{bn['median'] / b0['median']:.3f}" if ok else "n/a")
        lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    lines += ["", *prompt_sources_md(backends), *_counters_md(backends)]
    return "\n".join(lines) + "\n"


def prompt_sources_md(backends: dict[str, dict[str, Any]]) -> list[str]:
    """Prompt tokens by source per backend (median over repetitions), with the prefix-cache hit
    rate from `local_cache_hit` alone; empty when no server exported vLLM's per-source counter."""
    names = list(backends)
    if not any(c in b["aggregate"] for b in backends.values() for _, c in PROMPT_SOURCES[1:4]):
        return []

    def median(name: str, counter: str) -> float:
        s = backends[name]["aggregate"].get(counter)
        return s["median"] if s and s["n"] else math.nan

    lines = ["Prompt tokens by source per replay (median over repetitions). The P lane's tokens "
             "reach vLLM through the KV connector: vLLM counts them as `external_kv_transfer` "
             "and within its cached tokens, so compare prefix-cache reuse on the hit rate below.",
             "", "| source | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for label, counter in PROMPT_SOURCES:
        cells = ["n/a" if math.isnan(x) else f"{x:.0f}" for x in
                 (median(n, counter) for n in names)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rates = []
    for n in names:
        total = median(n, PROMPT_SOURCES[0][1])
        hits = median(n, PROMPT_SOURCES[2][1])
        known = total > 0 and not math.isnan(hits)  # NaN compares false: an absent counter
        rates.append(f"{100 * hits / total:.1f}%" if known else "n/a")
    lines += ["| prefix-cache hit rate (hits / prompt tokens) | " + " | ".join(rates) + " |", ""]
    return lines


def _counters_md(backends: dict[str, dict[str, Any]]) -> list[str]:
    names = list(backends)
    counters = sorted({k for b in backends.values() for k in b["aggregate"]
                       if k.startswith(PREFIX) or k.startswith("vllm:")})
    ours = [c for c in counters if c.startswith(PREFIX)]
    lines = ["Server counters per replay (median over repetitions, summed over ranks); "
             "n/a = not exported by that server.", ""]
    if not ours:
        lines += [f"`{PREFIX}*` (D wait, P wait-for-permit, segments per epoch, rendezvous time): "
                  "n/a -- no server exported them.", ""]
    if counters:
        lines += ["| counter | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for c in counters:
            cells = [_fmt(backends[n]["aggregate"][c]["median"]) if c in backends[n]["aggregate"]
                     else "n/a" for n in names]
            lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """ccdf.png (request and trajectory completion, all repetitions pooled) and makespan.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = {n: b for n, b in report["backends"].items() if b["runs"]}
    meta = report["meta"]
    caption = ", ".join(f"{k} {meta[k]}" for k in ("trace_source", "wait_scale", "reps", "layout")
                        if k in meta)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "request_completion_s", "request completion"),
                           (axes[1], "trajectory_completion_s", "trajectory completion")):
        for name, b in backends.items():
            xs = sorted(x for r in b["runs"] for x in r[key])
            if xs:
                ys = [1 - i / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
        ax.set_yscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("P(X >= x)")
        ax.set_title(f"CCDF of {title} (repetitions pooled)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    paths.append(out / "ccdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(backends), 4))
    for i, b in enumerate(backends.values()):
        s = b["aggregate"]["makespan_s"]
        ax.bar(i, s["median"], yerr=[[s["median"] - s["q1"]], [s["q3"] - s["median"]]],
               capsize=8, color=f"C{i}", alpha=0.8)
        ax.plot([i] * len(b["runs"]), [r["summary"]["makespan_s"] for r in b["runs"]], "k.",
                label="repetitions" if i == 0 else None)
    ax.set_xticks(range(len(backends)), list(backends))
    ax.set_ylabel("makespan (s)")
    ax.set_title("Makespan: median, IQR whiskers", fontsize=10)
    ax.set_xlabel(caption, fontsize=7)
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out / "makespan.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(report: dict[str, Any], out: str | Path) -> list[Path]:
    """report.json, report.md and the plots into `out` (created); returns the written paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_clean(report), indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    return [out / "report.json", out / "report.md", *plot(report, out)]


def _clean(x: Any) -> Any:
    """NaN -> null (strict JSON), floats rounded to microseconds/ppm to keep the file small."""
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 6)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
