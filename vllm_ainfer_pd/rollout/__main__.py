"""The `vllm-ainfer-pd-rollout` CLI (`python -m vllm_ainfer_pd.rollout`): generate, stats, replay,
compare, merge, ttft.

    generate --preset cpu --seed 0 --out trace.jsonl
    stats    --trace trace.jsonl            (or --preset paper)
    replay   --url http://127.0.0.1:8000 --preset cpu --wait-scale 0.1
    compare  --preset cpu --out rollout-out [--reps 3] [--variant normal='{"ainfer_pd":{...}}']
    ttft     rollout-out/records/pd-0.jsonl [...]   (TTFT by kind of turn, and the last trajectory)

The scale model that projects rollouts past the GPUs at hand is not part of the package: it runs
from a checkout (`python -m benchmarks.scale`, docs/scale-model.md).

Errors the user can fix (unreachable server, bad trace, bad flag value) print one `error:` line and
exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
from pathlib import Path

from vllm_ainfer_pd.rollout import backend_metrics
from vllm_ainfer_pd.rollout.generator import PRESETS, generate
from vllm_ainfer_pd.rollout.metrics import quantile, summarize
from vllm_ainfer_pd.rollout.replayer import ReplayConfig, ReplayError, replay
from vllm_ainfer_pd.rollout.trace import Trace, TraceError, dump_trace, load_trace

# The model each trace preset is sized for (models/generate.py presets).
MODEL_FOR_PRESET = {"cpu": "tiny", "gpu-small": "gpu", "paper": "gpu"}


def _trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="generate the trace from this preset (default: cpu)")
    g.add_argument("--trace", type=Path, help="a JSONL trace file (docs/rollout.md)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (with --preset)")


def _load(args: argparse.Namespace) -> Trace:
    return load_trace(args.trace) if args.trace else generate(args.preset or "cpu", args.seed)


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait-scale", type=float, default=1.0,
                   help="multiply every client wait (paper P1-P4: 0, 0.01, 0.03, 0.10; trace: 1)")
    p.add_argument("--concurrency", type=int, default=256, help="max requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def stats_table(trace: Trace) -> str:
    """Median/p99 of the trace's distributions next to its preset's targets (if it has one)."""
    preset = PRESETS.get(str(trace.meta.get("preset")))
    lines = [f"{len(trace.trajectories)} trajectories, {trace.num_requests} requests, "
             f"<= {max(len(t.turns) for t in trace.trajectories)} turns, longest trajectory "
             f"{trace.max_len} tokens",
             f"{'':10} {'median':>9} {'p99':>9} {'mean':>9}   target median / p99"]
    for name, xs in trace.stats().items():
        target = getattr(preset, name, None) if preset else None
        t = f"   {target.median:g} / {target.p99:g}" if target else ""
        mean = sum(xs) / len(xs) if xs else math.nan
        lines.append(f"{name:10} {quantile(xs, 0.5):9.2f} {quantile(xs, 0.99):9.2f} "
                     f"{mean:9.1f}{t}")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> None:
    trace = generate(args.preset or "cpu", args.seed)
    dump_trace(trace, args.out)
    print(stats_table(trace), file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)


def cmd_stats(args: argparse.Namespace) -> None:
    print(stats_table(_load(args)))


def cmd_replay(args: argparse.Namespace) -> None:
    trace = _load(args)
    cfg = ReplayConfig(args.url, model=args.model, wait_scale=args.wait_scale,
                       concurrency=args.concurrency, timeout_s=args.timeout,
                       id_seed=args.id_seed, progress=not args.no_progress)
    before = backend_metrics.scrape(args.url)
    result = replay(trace, cfg)
    counters = backend_metrics.delta(before, backend_metrics.after_run(args.url, args.dp))
    summary = summarize(result.records)
    ours = backend_metrics.backend_only(counters)
    out = {"summary": summary, "counters": counters, "model": result.model, **result.config}
    print(json.dumps(out, indent=1))
    if not ours:
        print(f"{backend_metrics.PREFIX}* counters: n/a (not exported by this server)")
    errors = sorted({r.error for r in result.records if r.error})
    for e in errors[:5]:
        print(f"request error: {e}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(
            {**out, "records": [vars(r) for r in result.records]}, indent=1))


def _model_path(name: str | None, preset: str | None, platform: str) -> str:
    from vllm_ainfer_pd.models.generate import PRESETS as MODEL_PRESETS
    from vllm_ainfer_pd.models.generate import ensure_model

    if name is None:
        name = MODEL_FOR_PRESET.get(preset or "", "tiny" if platform == "cpu" else "gpu")
    if name in MODEL_PRESETS:
        return str(ensure_model(name))
    if not Path(name).is_dir():
        raise ValueError(f"--model {name!r} is neither a model preset "
                         f"({', '.join(MODEL_PRESETS)}) nor a model folder")
    return name


def _variant(text: str) -> tuple[str, str]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r} must look like NAME=JSON")
    return name, raw


def _backend(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--backend {text!r} must look like NAME='FLAGS'")
    return name, tuple(shlex.split(flags))


def cmd_compare(args: argparse.Namespace) -> None:
    from vllm_ainfer_pd.rollout.compare import CompareConfig, compare
    from vllm_ainfer_pd.rollout.report import markdown

    trace = _load(args)
    platform = args.platform
    if platform == "auto":
        platform = "gpu" if shutil.which("nvidia-smi") else "cpu"
    if platform == "cpu":  # before generating or loading a model
        from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS

        trace.check_fits(CPU_ENGINE_ARGS["max_model_len"])
    schedule = args.schedule
    if schedule == "auto":
        schedule = "interleaved" if platform == "cpu" else "sequential"
    cfg = CompareConfig(
        model=_model_path(args.model, args.preset or (None if args.trace else "cpu"), platform),
        out=args.out, platform=platform, schedule=schedule, reps=args.reps,
        wait_scale=args.wait_scale,
        tp=args.tp, dp=args.dp, enable_expert_parallel=args.enable_expert_parallel,
        extra_args=tuple(args.serve_arg), variants=tuple(args.variant),
        extra_backends=tuple(args.backend),
        only=tuple(n for n in args.only.split(",") if n) if args.only else (),
        concurrency=args.concurrency, timeout_s=args.timeout, cached_replay=args.cached_replay,
        progress=not args.no_progress, meta={"trace_source": str(args.trace) if args.trace else
              f"preset {args.preset or 'cpu'} seed {args.seed}"})
    print(stats_table(trace), file=sys.stderr)
    rep, paths = compare(cfg, trace)
    print(markdown(rep))
    print("written: " + ", ".join(str(p) for p in paths))
    if any(b["error"] for b in rep["backends"].values()):
        sys.exit(1)


def cmd_merge(args: argparse.Namespace) -> None:
    import json

    from vllm_ainfer_pd.rollout import report

    merged = report.merge([json.loads(p.read_text()) for p in args.reports])
    paths = report.write(merged, args.out)
    print(report.markdown(merged))
    print("written: " + ", ".join(str(p) for p in paths))


def cmd_ttft(args: argparse.Namespace) -> None:
    from vllm_ainfer_pd.rollout.metrics import ttft_by_turn_kind
    from vllm_ainfer_pd.rollout.replayer import RequestRecord

    lines = [f"TTFT (s) by kind of turn; later turns split at {args.lane_min_tokens} new tokens"]
    for name, text in _records_texts(args.records):
        try:
            records = [RequestRecord(**json.loads(line)) for line in text.splitlines()
                       if line.strip()]
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(
                f"{name}: not a records file written by replay/compare ({e})") from None
        split = ttft_by_turn_kind(records, args.lane_min_tokens)
        cells = [f"{kind}: n={d['n']} p50={d['p50']:.3f} p99={d['p99']:.3f}"
                 for kind, d in split["ttft_s"].items()]
        burst = split["burst"]
        if burst is not None:
            cells.append(f"burst: {burst['prompt_tokens']} prompt tokens, last first token at "
                         f"{burst['done_s']:.2f} s ({burst['tokens_per_s'] / 1e3:.1f}k tokens/s)")
        chain = split["last_chain"]
        if chain is not None:
            cells.append(
                f"ended last: {split['last_trajectory']} (from {chain['start_s']:.2f} s: TTFT "
                f"{chain['ttft_s']:.2f} s, decode {chain['decode_s']:.2f} s, waits "
                f"{chain['wait_s']:.2f} s; longest turn {chain['longest_tokens']} tokens at "
                f"{1e3 * chain['longest_s_per_token']:.2f} ms per token)")
        lines.append(f"{name}: " + "; ".join(cells))
    print("\n".join(lines))


def _records_texts(paths: list[Path]):
    """(name, text) of each records file; a `.tar.gz` (what benchmarks/gpu_run.sh brings back)
    gives each `.jsonl` inside it."""
    import tarfile

    for path in paths:
        try:
            if path.name.endswith(".tar.gz"):
                with tarfile.open(path) as tar:
                    for member in sorted(tar.getmembers(), key=lambda m: m.name):
                        if member.isfile() and member.name.endswith(".jsonl"):
                            yield (f"{path}:{member.name}",
                                   tar.extractfile(member).read().decode())
            else:
                yield str(path), path.read_text()
        except (OSError, tarfile.TarError) as e:
            raise ValueError(f"{path}: cannot read records ({e})") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-ainfer-pd-rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="write a synthetic trace")
    g.add_argument("--preset", choices=list(PRESETS), default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", type=Path, required=True)
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("stats", help="quantiles of a trace next to its preset's targets")
    _trace_args(s)
    s.set_defaults(fn=cmd_stats)

    r = sub.add_parser("replay", help="replay a trace once against a running server")
    r.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    r.add_argument("--model", default=None, help="model name (default: the server's first)")
    r.add_argument("--id-seed", type=int, default=0, help="seed of the increments' token ids")
    r.add_argument("--dp", type=int, default=1,
                   help="the server's --data-parallel-size: after the replay one short request "
                        "per DP rank brings in each rank's last lane counters")
    r.add_argument("--json-out", type=Path, default=None, help="also write summary + records")
    _trace_args(r)
    _replay_args(r)
    r.set_defaults(fn=cmd_replay)

    c = sub.add_parser("compare", help="start stock and ainfer_pd servers, replay, report")
    _trace_args(c)
    _replay_args(c)
    c.add_argument("--out", type=Path, required=True, help="output folder (report.md, plots)")
    c.add_argument("--reps", type=int, default=3, help="replays per backend")
    c.add_argument("--model", default=None,
                   help="model folder or models preset (default: tiny for cpu, gpu otherwise)")
    c.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto")
    c.add_argument("--schedule", choices=["auto", "interleaved", "sequential"], default="auto",
                   help="interleaved: all servers up, order alternating per repetition; "
                        "sequential: one server at a time (auto: interleaved on cpu)")
    c.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size")
    c.add_argument("--dp", type=int, default=1, help="--data-parallel-size")
    c.add_argument("--enable-expert-parallel", action="store_true")
    c.add_argument("--variant", type=_variant, action="append", default=[],
                   help="NAME=JSON: one more ainfer_pd server with --additional-config JSON")
    c.add_argument("--backend", type=_backend, action="append", default=[],
                   help="NAME='FLAGS': one more server with these extra `vllm serve` flags (e.g. "
                        "stock_mp='--distributed-executor-backend mp')")
    c.add_argument("--serve-arg", action="append", default=[],
                   help="extra `vllm serve` flag for every server (repeat; e.g. "
                        "--serve-arg=--max-num-seqs=64)")
    c.add_argument("--only", default=None,
                   help="comma-separated backend names to run, in this order (e.g. one GPU's "
                        "share of a comparison; join the parts with `merge`)")
    c.add_argument("--cached-replay", action="store_true",
                   help="after each repetition, replay its prompts again on the same server "
                        "(backend <name>_cached): prefill then finds its prefixes cached, a "
                        "bound on what scheduling prefill differently could reach")
    c.set_defaults(fn=cmd_compare)

    m = sub.add_parser("merge", help="join the report.json of comparisons run with --only")
    m.add_argument("reports", type=Path, nargs="+", help="report.json files, base backend first")
    m.add_argument("--out", type=Path, required=True, help="output folder (report.md, plots)")
    m.set_defaults(fn=cmd_merge)

    t = sub.add_parser("ttft", help="TTFT by kind of turn (first / lane-sized / inline-sized) "
                                    "from per-request records")
    t.add_argument("records", type=Path, nargs="+",
                   help="records/<backend>-<rep>.jsonl files, or a records.tar.gz of them")
    t.add_argument("--lane-min-tokens", type=int, default=512,
                   help="the P lane's threshold, ainfer_pd.p_lane_min_tokens (default 512, "
                        "the lane's own at DP = 1)")
    t.set_defaults(fn=cmd_ttft)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except (ReplayError, TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
