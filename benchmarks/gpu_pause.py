"""Pausing with P in flight on the GPU (ainfer_pd_testing/pause_resume.py, as
tests/test_pause_resume.py does on the CPU), with what only the GPU has: CUDA graphs, vLLM's
async scheduling and sleep mode.

    python benchmarks/gpu_pause.py --model DIR --out pause.json [--dtype bfloat16]

One ainfer_pd `AsyncLLM` (TP=1, `enable_sleep_mode`, the test weight update mixed into the
worker): `keep` pause with new weights, `wait`, `abort`, then `sleep(level=1)` in the middle of a
rollout (vLLM pauses with `abort` first: `paused_rollout(..., sleep_level=1)`), `wake_up()`, and
a fresh rollout. Then stock vLLM with the same update judges every request (parity.py's tie
rule). Run with VLLM_BATCH_INVARIANT=1 for bf16 (the lane's prefill and stock's take different
batch shapes). Writes JSON; exit 1 on a failed check or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import traceback

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, run as `python benchmarks/gpu_pause.py` with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

MAX_TOKENS = 16
SEED = 5  # the weight update, pushed during the `keep` pause
PROMPT_SEED = {"keep": 0, "wait": 1, "abort": 2}


def prompts(seed: int, n: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(300, 400))] for _ in range(n)]


async def ours_runs(engine_args: dict, lane: dict | None, sleep: bool,
                    modes: list[str], weight_update: bool) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from ainfer_pd_testing.pause_resume import lane_status, paused_rollout, plain_rollout
    from ainfer_pd_testing.weight_update import EXTENSION

    backend = {} if lane is None else dict(distributed_executor_backend="ainfer_pd",
                                           additional_config=lane)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        **engine_args, worker_extension_cls=EXTENSION, enable_sleep_mode=sleep, **backend))
    runs: dict = {}
    try:
        for mode in modes:
            if mode == "update":  # the weight update alone, with no pause and nothing running
                await engine.collective_rpc("perturb_weights", args=(SEED,))
                continue
            runs[mode] = await paused_rollout(engine, prompts(PROMPT_SEED[mode]), MAX_TOKENS, mode,
                                              weight_seed=SEED if mode == "keep" and weight_update
                                              else None,
                                              request_prefix=mode)
            print(mode, "paused in", round(runs[mode].pause_s, 3), "s; lane before/at:",
                  runs[mode].lane_before_pause, runs[mode].lane_at_pause, flush=True)
        runs["fresh_before_sleep"] = await plain_rollout(engine, prompts(4), MAX_TOKENS)
        if sleep:  # vLLM pauses with `abort` first
            runs["sleep"] = await paused_rollout(engine, prompts(3), MAX_TOKENS, "abort",
                                                 request_prefix="sleep", sleep_level=1)
        runs["fresh"] = await plain_rollout(engine, prompts(4), MAX_TOKENS, "after")
        runs["lane"] = await lane_status(engine)
        runs["all_blocks_free"] = await engine.reset_prefix_cache(reset_running_requests=True)
    finally:
        engine.shutdown()
    return runs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", choices=["ainfer_pd", "normal", "stock"],
                        default="ainfer_pd",
                        help="stock: the same pauses and sleep on stock vLLM (a control); "
                             "normal: our engine with the lane off")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="JSON, extra engine arguments for both engines, e.g. "
                             "'{\"async_scheduling\": false}'")
    parser.add_argument("--modes", default="keep,wait,abort",
                        help="the pauses to run before the fresh rollouts (comma-separated; "
                             "'' for none; `update`: push the new weights with no pause)")
    parser.add_argument("--no-weight-update", action="store_true",
                        help="the `keep` pause pushes no new weights")
    parser.add_argument("--no-sleep", action="store_true",
                        help="skip the sleep cycle (vLLM's sleep mode needs CUDA: a CPU smoke run)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    # 64 tokens per step: each prompt is prefilled in parts over several epochs, so the pauses
    # meet P in flight while earlier prompts decode.
    engine_args = {**dict(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=16,
                          max_num_batched_tokens=64, gpu_memory_utilization=0.3, seed=0),
                   **args.engine_args}  # --engine-args may also override these
    lane = {"ainfer_pd": {"p_lane_min_tokens": 32}} if args.backend == "ainfer_pd" else (
        {"ainfer_pd": {"mode": "normal"}} if args.backend == "normal" else None)
    result: dict = {"engine_args": engine_args, "ours_additional_config": lane,
                    "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT"), "checks": {}}
    failed = []
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        from gpu_parity import versions

        result["versions"] = versions()
        modes = [m for m in args.modes.split(",") if m]
        runs = asyncio.run(ours_runs(engine_args, lane, not args.no_sleep, modes,
                                     not args.no_weight_update))
        updated = "update" in modes or ("keep" in modes and not args.no_weight_update)
        failed += judge(runs, engine_args, [m for m in modes if m != "update"], updated, result)
    except BaseException as exc:
        result["error"] = repr(exc)
        result["traceback"] = traceback.format_exc()
        failed.append("error")
    result["failed_checks"] = failed
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, default=str)[:3000])
    return 1 if failed else 0


def judge(runs: dict, engine_args: dict, modes: list[str], updated: bool,
          result: dict) -> list[str]:
    from vllm import LLM

    from ainfer_pd_testing.parity import LLMRunner, compare, stock_alone
    from ainfer_pd_testing.pause_resume import judge_continuations
    from ainfer_pd_testing.weight_update import EXTENSION

    failed = []
    checks = result["checks"]
    for mode in modes + (["sleep"] if "sleep" in runs else []):
        run = runs[mode]
        checks[mode] = {"pause_s": run.pause_s, "tokens_before": [len(b) for b in run.before],
                        "finish_reasons": run.finish_reasons, "errors": run.errors,
                        "lane_before": run.lane_before_pause, "lane_at_pause": run.lane_at_pause}
        if run.errors or (run.lane_at_pause or {}).get("inflight"):
            failed.append(mode)
    checks["lane_after"] = runs["lane"]
    checks["all_blocks_free"] = runs["all_blocks_free"]
    stock_llm = LLM(**engine_args, worker_extension_cls=EXTENSION)
    try:
        stock = LLMRunner(stock_llm)
        if updated:  # the weights ours had after the keep pause (or the update)
            stock_llm.collective_rpc("perturb_weights", args=(SEED,))
        for mode in [m for m in modes if m != "abort"]:
            report = judge_continuations(prompts(PROMPT_SEED[mode]), runs[mode], MAX_TOKENS,
                                         stock)
            checks[mode]["parity"] = {"exact": report.exact, "tie": report.tie,
                                      "fail": report.fail, "details": report.details}
            print(mode, report, flush=True)
            if report.fail:
                failed.append(f"{mode} parity")
        expected = stock.generate(prompts(4), MAX_TOKENS)
        for name in ("fresh_before_sleep", "fresh"):
            report = compare(prompts(4), expected, runs[name], stock.teacher_force)
            checks[name] = {"exact": report.exact, "tie": report.tie, "fail": report.fail,
                            "details": report.details,
                            "failed_stock_alone": stock_alone(stock, prompts(4), expected,
                                                              runs[name], report.failed,
                                                              MAX_TOKENS)}
            print(name, report, flush=True)
            if report.fail:
                failed.append(f"{name} parity")
    finally:
        stock_llm.llm_engine.engine_core.shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main())
