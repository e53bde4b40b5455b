"""Decode-only overhead of the P lane: the backend with the lane on (`mode=pd`) vs the same backend
with it off (`mode=normal`), and stock vLLM for context, on a workload with no prefill worth a lane
(8-token prompts, long greedy decodes). All engines stay up and repetitions alternate between
them, or (`--sequential`) one engine is up at a time, in two passes of opposite order.

    python benchmarks/decode_overhead.py --reps 5 --out benchmarks/results/cpu/decode_overhead.json
    python benchmarks/decode_overhead.py --gpu --model .gpu/tiny --requests 64 --max-tokens 256 ...
    python benchmarks/decode_overhead.py --dp 2 --reps 3 \
        --out benchmarks/results/cpu/decode_overhead_dp2_ep.json
    python benchmarks/decode_overhead.py --dp 2 --sequential --reps 4 --max-tokens 256 \
        --out benchmarks/results/cpu/decode_overhead_dp2_ep_gate.json

`--gpu`: bf16 with vLLM's defaults (torch.compile, CUDA graphs), the three engines side by side on
one GPU (a quarter of its memory each), async scheduling where vLLM turns it on.

`--dp 2`: DP=2 with expert parallelism through `vllm serve` (stock vLLM 0.26 cannot serve DP+EP
on the CPU, so `pd` is compared with `normal` alone): `pd` with the epoch gate off and `pd_gate`
with it on (`epoch_gate_fill=0.8`, `epoch_gate_rounds=96`, the defaults), both with the lane's
threshold at 512 tokens so that no prompt takes the lane; vLLM spreads the requests over both
ranks.

Reports each engine's median wall time per repetition with [min, max] and the ratio to `normal`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, run as `python benchmarks/decode_overhead.py` with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model folder (default: the tiny preset)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu", action="store_true", help="GPU engine settings (see above)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks with EP (CPU)")
    parser.add_argument("--sequential", action="store_true",
                        help="one engine up at a time, two passes of opposite order, --reps "
                        "repetitions per engine and pass")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from ainfer_pd_testing.parity import offline_llm
    from vllm_ainfer_pd.models import ensure_model

    model = args.model or str(ensure_model("tiny", 0))
    prompts = [[3 + (7 * i + j) % 500 for j in range(8)] for i in range(args.requests)]
    engines = {
        "pd": dict(backend="ainfer_pd", additional_config={"ainfer_pd": {"mode": "pd"}}),
        "normal": dict(backend="ainfer_pd", additional_config={"ainfer_pd": {"mode": "normal"}}),
        "stock": dict(backend=None),
    }
    if args.dp > 1:
        del engines["stock"]
        # At DP > 1 the lane's defaults take every prompt and open epochs through the gate:
        # the 512-token threshold keeps the 8-token prompts inline (no lane work), `pd` with
        # the gate off and `pd_gate` with it on as the defaults set it.
        decode_only = {"mode": "pd", "p_lane_min_tokens": 512}
        engines["pd"] = dict(backend="ainfer_pd", additional_config={"ainfer_pd": {
            **decode_only, "epoch_gate_fill": 0.0}})
        engines["pd_gate"] = dict(backend="ainfer_pd", additional_config={"ainfer_pd": {
            **decode_only, "epoch_gate_fill": 0.8, "epoch_gate_rounds": 96}})
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    lanes: dict[str, dict] = {}

    def start(stack: ExitStack, name: str):
        print(f"[decode-overhead] starting {name}", file=sys.stderr, flush=True)
        kw = engines[name]
        runner = stack.enter_context(
            gpu_llm(model, **kw) if args.gpu else dp_server(model, args.dp, **kw)
            if args.dp > 1 else offline_llm(model, 1, **kw))
        runner.generate(prompts, 8)  # warm-up with the full batch
        return runner

    def timed(name: str, runner) -> None:
        begin = time.perf_counter()
        outputs[name] = runner.generate(prompts, args.max_tokens)
        times[name].append(time.perf_counter() - begin)
        print(f"[decode-overhead] {name} rep {len(times[name])}: {times[name][-1]:.3f} s",
              file=sys.stderr, flush=True)

    if args.sequential:
        # One engine up at a time (an idle DP server's processes still take CPU time from the
        # measured one on a small machine), in two passes of opposite order.
        for order in (list(engines), list(reversed(engines))):
            for name in order:
                with ExitStack() as stack:
                    runner = start(stack, name)
                    for _ in range(args.reps):
                        timed(name, runner)
                    if name.startswith("pd"):  # summed over the engine's two servers
                        counts = lane_counters(runner)
                        lanes[name] = {k: lanes.get(name, {}).get(k, 0) + v
                                       for k, v in counts.items()}
    else:
        with ExitStack() as stack:
            runners = {name: start(stack, name) for name in engines}
            for rep in range(args.reps):
                for name in list(engines) if rep % 2 == 0 else list(reversed(engines)):
                    timed(name, runners[name])
            lanes = {name: lane_counters(runners[name]) for name in engines
                     if name.startswith("pd")}
    base = statistics.median(times["normal"])
    result = {
        "platform": "gpu" if args.gpu else "cpu",
        "layout": f"DP={args.dp} + EP" if args.dp > 1 else "TP=1",
        "workload": {"requests": args.requests, "prompt_tokens": 8,
                     "max_tokens": args.max_tokens, "reps": args.reps},
        "schedule": "sequential, two passes" if args.sequential else "all engines up at once",
        "seconds": {n: {"median": statistics.median(t), "min": min(t), "max": max(t), "all": t}
                    for n, t in times.items()},
        "ratio_to_normal": {n: statistics.median(t) / base for n, t in times.items()},
        "same_tokens_pd_vs_normal": outputs["pd"] == outputs["normal"],
        "pd_lane_epochs": lanes["pd"]["epochs"],
        "pd_rendezvous_phases": lanes["pd"]["rendezvous_phases"],
        "lane_counters": lanes,
    }
    if "pd_gate" in outputs:
        result["same_tokens_pd_gate_vs_normal"] = outputs["pd_gate"] == outputs["normal"]
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def lane_counters(runner) -> dict[str, float]:
    """The `pd` engine's lane counters (summed over ranks behind a server; a rank that never
    reported any counts 0)."""
    if not hasattr(runner, "url"):
        return runner.worker_status()[0]["p_lane"]
    from vllm_ainfer_pd.rollout.backend_metrics import by_rank, read_metrics_text

    ranks = by_rank(read_metrics_text(runner.url)).values()
    return {name: sum(r.get(f"vllm_ainfer_pd_{name}_total", 0) for r in ranks)
            for name in ("epochs", "rendezvous_phases", "gate_waits")}


@contextlib.contextmanager
def dp_server(model: str, dp: int, backend: str, additional_config: dict):
    """`vllm serve` at DP=`dp` with expert parallelism, on the CPU harness's settings."""
    from ainfer_pd_testing.parity import ServerRunner
    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
    from vllm_ainfer_pd.rollout.server import VllmServer

    flags = serve_args(CPU_ENGINE_ARGS) + [
        "--distributed-executor-backend", backend, "--additional-config",
        json.dumps(additional_config), "--data-parallel-size", str(dp),
        "--enable-expert-parallel"]
    lane = additional_config["ainfer_pd"]
    name = lane["mode"] + ("-gate" if lane.get("epoch_gate_fill") else "")
    with VllmServer(model, flags, cpu_env(dp), name=f"decode-overhead-dp{dp}-{name}") as srv:
        yield ServerRunner(srv.url, model)


@contextlib.contextmanager
def gpu_llm(model: str, backend: str | None = None, **engine_args):
    from vllm import LLM

    from ainfer_pd_testing.parity import LLMRunner

    if backend is not None:
        engine_args["distributed_executor_backend"] = backend
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
              gpu_memory_utilization=0.25, seed=0, **engine_args)
    try:
        yield LLMRunner(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
