"""Greedy parity of `vllm serve` layouts on the CPU with the P lane on, against the matched
baseline.

    python benchmarks/serve_parity_cpu.py --tp 2 --dp 2 \
        --out benchmarks/results/cpu/parity_tp2_dp2_ep.json

Serves the parity waves (tests/test_parity_offline.py) with `mode=pd` (lane on for prompts of >= 32
uncached tokens) and with `mode=normal` in the same layout (`--data-parallel-size N
--enable-expert-parallel` when DP > 1: stock vLLM cannot serve DP+EP on the CPU, so `normal` is the
baseline there), one server at a time; stock TP=1 offline is the teacher forcer for the tie rule.
Records per-rank lane counters from `/metrics` and checks that every rank ran the same segments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, run as `python benchmarks/serve_parity_cpu.py` with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve_waves(model: str, tp: int, dp: int, lane: dict, waves, max_tokens: int,
                speculative_config: dict | None = None):
    from ainfer_pd_testing.metrics import settled_rank_metrics
    from ainfer_pd_testing.parity import ServerRunner, run_waves
    from vllm_ainfer_pd.rollout.backend_metrics import parse, read_metrics_text
    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
    from vllm_ainfer_pd.rollout.server import VllmServer

    args = serve_args(CPU_ENGINE_ARGS) + [
        "--distributed-executor-backend", "ainfer_pd", "--tensor-parallel-size", str(tp),
        "--additional-config", json.dumps({"ainfer_pd": lane})]
    if dp > 1:
        args += ["--data-parallel-size", str(dp), "--enable-expert-parallel"]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    start = time.time()
    with VllmServer(model, args, cpu_env(tp * dp), name=f"parity-{lane['mode']}") as srv:
        up = time.time() - start
        out = run_waves(ServerRunner(srv.url, model), waves, max_tokens)
        lanes = settled_rank_metrics(srv.url, model, dp)  # every rank's last epochs reported
        text = read_metrics_text(srv.url)
    spec = {k: v for k, v in parse(text).items() if k.startswith("vllm:spec_decode")}
    return out, {"startup_s": round(up, 1), "lane_by_rank": lanes,
                 **({"spec_decode": spec} if speculative_config is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--p-host", default="auto", help="the lane's p_host (docs/worker.md)")
    parser.add_argument("--segment-policy", default=None,
                        help="the lane's segment_policy (default: the backend's, docs/worker.md)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON for both servers, e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 3}' (the teacher forcer has none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from ainfer_pd_testing.parity import compare, offline_llm, parity_waves, run_waves
    from vllm_ainfer_pd.models import ensure_model

    model = str(ensure_model("tiny", 0))
    waves = parity_waves(vocab_size=512)
    prompts = [p for w in waves for p in w]
    result: dict = {"layout": {"tp": args.tp, "dp": args.dp, "expert_parallel": args.dp > 1},
                    "p_host": args.p_host, "segment_policy": args.segment_policy,
                    "speculative_config": args.speculative_config}
    lane = {"p_lane_min_tokens": 32, "p_host": args.p_host}
    if args.segment_policy is not None:
        lane["segment_policy"] = args.segment_policy
    outs = {}
    for mode in ("pd", "normal"):
        print(f"[serve-parity] mode={mode} TP={args.tp} DP={args.dp}", file=sys.stderr, flush=True)
        outs[mode], result[mode] = serve_waves(model, args.tp, args.dp, {"mode": mode, **lane},
                                               waves, args.max_tokens, args.speculative_config)
    with offline_llm(model, 1) as stock:
        report = compare(prompts, outs["normal"], outs["pd"], stock.teacher_force)
        vs_stock = compare(prompts, run_waves(stock, waves, args.max_tokens), outs["pd"],
                           stock.teacher_force)
    result["pd_vs_normal"] = {"exact": report.exact, "tie": report.tie, "fail": report.fail}
    result["pd_vs_stock_tp1"] = {"exact": vs_stock.exact, "tie": vs_stock.tie,
                                 "fail": vs_stock.fail}
    lanes = result["pd"]["lane_by_rank"]
    segments = {r: v.get("vllm_ainfer_pd_segments_total", 0) for r, v in lanes.items()}
    result["segments_equal_on_all_ranks"] = len(set(segments.values())) == 1
    result["ok"] = (report.fail == 0 and vs_stock.fail == 0
                    and result["segments_equal_on_all_ranks"]
                    and len(lanes) == args.tp * args.dp and min(segments.values()) > 0)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
