"""Greedy parity on the GPU: stock vLLM vs ainfer_pd in the same layout (run on the lent H200s).

    python benchmarks/gpu_parity.py --model DIR --tp 1 --out parity_tp1.json
    python benchmarks/gpu_parity.py --model DIR --dp 2 --out parity_dp2_ep.json   # vllm serve, EP

Offline `LLM()` for TP layouts; `vllm serve` with `--data-parallel-size N --enable-expert-parallel`
for DP (vLLM's `LLM()` refuses DP>1), compared with stock vLLM serving the same layout.

Both engines use CUDA graphs and torch.compile (vLLM's defaults) and the V1 GPU model runner. The
stock engine stays up as the teacher forcer for the tie rule (vllm_ainfer_pd/testing/parity.py).
Writes a JSON report with exact/tie/fail counts, timings and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1, help=">1: DP with expert parallelism, served")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True)
    # On the lent 2 x H200 machine vLLM's custom all-reduce hit an illegal memory access in stock
    # vLLM's first TP=2 forward (2026-11-30); this turns it off for both engines alike.
    parser.add_argument("--disable-custom-all-reduce", action="store_true")
    args = parser.parse_args()

    import torch
    import vllm
    from vllm import LLM

    from vllm_ainfer_pd.testing.parity import LLMRunner, compare, parity_waves, run_waves

    if args.dp > 1:
        return serve_parity(args)

    engine_args = dict(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tp,
                       max_model_len=2048, max_num_seqs=32, gpu_memory_utilization=0.3, seed=0,
                       disable_custom_all_reduce=args.disable_custom_all_reduce)
    waves = parity_waves(vocab_size=512)
    prompts = [p for w in waves for p in w]
    result = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                           "cuda": torch.version.cuda,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                           "gpu": torch.cuda.get_device_name(0)},
              "engine_args": engine_args}
    t0 = time.time()
    stock_llm = LLM(**engine_args)
    stock = LLMRunner(stock_llm)
    result["stock_start_s"] = time.time() - t0
    stock_out = run_waves(stock, waves, args.max_tokens)
    t0 = time.time()
    ours_llm = LLM(**engine_args, distributed_executor_backend="ainfer_pd")
    ours = LLMRunner(ours_llm)
    result["ours_start_s"] = time.time() - t0
    result["ours_workers"] = ours.worker_status()
    ours_out = run_waves(ours, waves, args.max_tokens)
    ours_llm.llm_engine.engine_core.shutdown()
    report = compare(prompts, stock_out, ours_out, stock.teacher_force)
    stock_llm.llm_engine.engine_core.shutdown()
    result.update(exact=report.exact, tie=report.tie, fail=report.fail, details=report.details)
    print(report, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


def serve_parity(args) -> None:
    import torch
    import vllm

    from vllm_ainfer_pd.testing.parity import ServerRunner, compare, parity_waves, run_waves
    from vllm_ainfer_pd.testing.server import VllmServer

    flags = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", "32",
             "--gpu-memory-utilization", "0.3", "--seed", "0", "--tensor-parallel-size",
             str(args.tp), "--data-parallel-size", str(args.dp), "--enable-expert-parallel"]
    waves = parity_waves(vocab_size=512)
    prompts = [p for w in waves for p in w]
    result = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(0),
                           "gpus": torch.cuda.device_count()}, "flags": flags}
    with VllmServer(args.model, flags, name="stock") as stock_srv:
        stock = ServerRunner(stock_srv.url, args.model)
        stock_out = run_waves(stock, waves, args.max_tokens)
        with VllmServer(args.model, flags + ["--distributed-executor-backend", "ainfer_pd"],
                        name="ours") as ours_srv:
            ours_out = run_waves(ServerRunner(ours_srv.url, args.model), waves, args.max_tokens)
            result["ours_log_has_ainfer_worker"] = "AInferPDScheduler" in ours_srv.log_text()
        report = compare(prompts, stock_out, ours_out, stock.teacher_force)
    result.update(exact=report.exact, tie=report.tie, fail=report.fail, details=report.details)
    print(report, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
