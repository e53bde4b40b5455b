"""`python -m benchmarks.scale ...` (from the checkout's root): the scale model from the command
line.

    validate [--out DIR]                              every measured run against the model
    run [--presets gpu,gpu-mla,deepseek-v3] [--dp 1,2,4,8,16] [--wait-scale 0.1]
        [--trace-preset gpu-quick] [--seeds 0,1,2] [--no-paper] [--out DIR]
    gate-sweep [--out DIR]                            the epoch gate's settings
    prefill-bounds [--out DIR]                        stock with prefill cached, beside pd
    simulate --profile FILE (--trace FILE | --preset NAME) [--engine pd] [--dp 2]
        [--cadence 8] [--wait-scale 0.1] [--cached none|all|later]
                                                      one modelled replay, its summary as JSON

Profiles and measured runs default to `benchmarks/results/` (`--profiles`, `--results`). Errors
the user can fix (a bad profile, trace or flag value) print one `error:` line and exit with
status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.scale import project, validate
from benchmarks.scale.costs import Layout
from benchmarks.scale.engines import EngineSpec
from benchmarks.scale.profile import load_profile
from benchmarks.scale.sim import CACHED, simulate
from benchmarks.scale.validate import RESULTS
from vllm_ainfer_pd.config import AInferPDConfig
from vllm_ainfer_pd.rollout.generator import generate
from vllm_ainfer_pd.rollout.trace import TraceError, load_trace


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    psub = p.add_subparsers(dest="cmd", required=True)
    v = psub.add_parser("validate", help="model every measured run in benchmarks/results")
    v.add_argument("--out", type=Path, default=None, help="write validation.md/.json here")
    v.add_argument("--results", type=Path, default=RESULTS,
                   help="the measured runs (default: benchmarks/results)")
    v.add_argument("--profiles", type=Path, default=None,
                   help="folder of profile_*.json (default: RESULTS/scale)")
    v.set_defaults(fn=cmd_validate)
    r = psub.add_parser("run", help="project DP = 1..16 with expert parallelism (projected)")
    r.add_argument("--presets", default="gpu,gpu-mla,deepseek-v3")
    r.add_argument("--dp", default="1,2,4,8,16")
    r.add_argument("--wait-scale", type=float, default=0.1)
    r.add_argument("--trace-preset", default="gpu-quick", help="one rank's load, repeated per rank")
    r.add_argument("--seeds", default="0,1,2", help="trace seeds; rows give the median")
    r.add_argument("--no-paper", action="store_true", help="skip the paper's setting")
    r.add_argument("--profiles", type=Path, default=RESULTS / "scale",
                   help="folder of profile_*.json (default: benchmarks/results/scale)")
    r.add_argument("--out", type=Path, default=None, help="write projection.md/.json/.png here")
    r.set_defaults(fn=cmd_run)
    g = psub.add_parser("gate-sweep", help="the epoch gate's settings against the best cadence "
                                           "(projected): how its defaults were chosen")
    g.add_argument("--profiles", type=Path, default=RESULTS / "scale",
                   help="folder of profile_*.json (default: benchmarks/results/scale)")
    g.add_argument("--out", type=Path, default=None, help="write gate_sweep.md/.json here")
    g.set_defaults(fn=cmd_gate_sweep)
    b = psub.add_parser("prefill-bounds", help="stock with later turns' or every prompt's "
                        "prefill cached, beside pd, at DP = 1 (projected)")
    b.add_argument("--profiles", type=Path, default=RESULTS / "scale",
                   help="folder of profile_gpu.json and profile_gpu_mla.json")
    b.add_argument("--out", type=Path, default=None,
                   help="write prefill_bounds.md/.json here")
    b.set_defaults(fn=cmd_prefill_bounds)
    s = psub.add_parser("simulate", help="one modelled replay of a trace")
    s.add_argument("--profile", type=Path, required=True)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--trace", type=Path)
    g.add_argument("--preset")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--engine", default="pd", choices=["stock", "cadence", "normal", "pd"])
    s.add_argument("--cadence", type=int, default=1)
    s.add_argument("--dp", type=int, default=1)
    s.add_argument("--wait-scale", type=float, default=1.0)
    s.add_argument("--cached", choices=CACHED, default="none",
                   help="what the prefix cache holds before the replay: none, all prompts "
                        "(rollout compare --cached-replay) or every later turn's")
    s.set_defaults(fn=cmd_simulate)
    return p


def cmd_validate(args: argparse.Namespace) -> None:
    runs = validate.load_runs(args.results / "scale" / "runs.json")
    rows = validate.validate(args.results, profiles_dir=args.profiles, runs=runs)
    print(validate.markdown(rows))
    print("\n".join(validate.summary_lines(rows)))
    if args.out:
        paths = validate.write(rows, args.out, runs.excluded)
        print("written: " + ", ".join(map(str, paths)))


def cmd_run(args: argparse.Namespace) -> None:
    profs = project.default_profiles(args.profiles)
    presets = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(presets) - set(profs))
    if unknown:
        raise ValueError(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(profs)}")
    dps = tuple(int(x) for x in args.dp.split(",") if x)

    def progress(row: dict) -> None:
        q = row["ratios"]
        print(f"[project] {row['preset']} DP={row['dp']}: pd / stock makespan "
              f"{q['pd/stock']['makespan_s']:.3f}, pd / best cadence "
              f"{q['pd/best_cadence']['makespan_s']:.3f}, pd_nogate / best cadence "
              f"{q['pd_nogate/best_cadence']['makespan_s']:.3f} ({project.LABEL})",
              file=sys.stderr)

    seeds = tuple(int(x) for x in args.seeds.split(",") if x)
    rows = project.project({k: profs[k] for k in presets}, args.trace_preset, args.wait_scale,
                           dps, progress, seeds)
    paper = [] if args.no_paper else project.project_paper(profs["gpu"])
    print(project.markdown(rows))
    if paper:
        print("\n" + project.paper_markdown(paper))
    if args.out:
        meta = {"trace_preset": args.trace_preset, "wait_scale": args.wait_scale,
                "presets": presets, "dp": list(dps), "seeds": list(seeds),
                "cadences": list(project.CADENCES), "pd_nogate": dict(project.NO_GATE),
                "pd": {k: getattr(AInferPDConfig(), k)
                       for k in ("p_lane_min_tokens", "epoch_gate_fill", "epoch_gate_rounds")}}
        print("written: " + ", ".join(map(str, project.write(rows, paper, args.out, meta))))


def _print_and_write(out: Path | None, name: str, title: str, rows: list, text: str) -> None:
    """A table's markdown on stdout, and with `out` its `<name>.md` and `<name>.json` there."""
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(
            {"label": project.LABEL, "seeds": list(project.SEEDS), "rows": rows}, indent=1) + "\n")
        (out / f"{name}.md").write_text(f"# Scale model: {title}\n\n" + text)
        print(f"written: {out / (name + '.md')}, {out / (name + '.json')}")


def cmd_gate_sweep(args: argparse.Namespace) -> None:
    rows = project.gate_sweep(project.default_profiles(args.profiles))
    _print_and_write(args.out, "gate_sweep", "the epoch gate's settings", rows,
                     project.gate_sweep_markdown(rows))


def cmd_prefill_bounds(args: argparse.Namespace) -> None:
    rows = project.prefill_bounds(project.default_profiles(args.profiles))
    _print_and_write(args.out, "prefill_bounds", "what prefill costs a rollout at all", rows,
                     project.prefill_bounds_markdown(rows))


def cmd_simulate(args: argparse.Namespace) -> None:
    trace = load_trace(args.trace) if args.trace else generate(args.preset, args.seed)
    spec = EngineSpec(args.engine, cadence=args.cadence)
    res = simulate(trace, load_profile(args.profile), Layout(dp=args.dp, ep=args.dp > 1), spec,
                   args.wait_scale, args.cached)
    print(json.dumps({"label": "modelled", "engine": spec.label, "dp": args.dp,
                      "cached": args.cached,
                      "summary": res.summary, "counters": res.counters}, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
