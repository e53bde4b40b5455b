"""Greedy parity on the GPU: stock vLLM vs ainfer_pd in the same layout (run on the lent H200s).

    python benchmarks/gpu_parity.py --model DIR --tp 1 --out parity_tp1.json
    python benchmarks/gpu_parity.py --model DIR --dp 2 --out parity_dp2_ep.json   # vllm serve, EP
    # the P lane on for most of the 16 prompts (>= 32 uncached tokens go to the lane):
    python benchmarks/gpu_parity.py --model DIR --tp 1 --out p.json \
        --additional-config '{"ainfer_pd": {"p_lane_min_tokens": 32}}'

Offline `LLM()` for TP layouts; `vllm serve` with `--data-parallel-size N --enable-expert-parallel`
for DP (vLLM's `LLM()` refuses DP>1), compared with stock vLLM serving the same layout.

Both engines use CUDA graphs and torch.compile (vLLM's defaults) and the V1 GPU model runner, unless
`--enforce-eager` (both engines, for diagnosis). `--additional-config` goes to our engine only;
`--load-format`, `--compilation-config` and `--disable-custom-all-reduce` go to both. The stock
engine stays up as the teacher forcer for the tie rule (ainfer_pd_testing/parity.py).
Writes a JSON report with exact/tie/fail counts, our workers' P-lane counters (offline: every rank's
`ainfer_pd_status`; served: the `vllm_ainfer_pd_*` lines of `/metrics`), timings and versions. If an
engine fails, the report is still written, with the error and its traceback, and the exit status
is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import traceback

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, run as `python benchmarks/gpu_parity.py` with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

from vllm_ainfer_pd.config import ConfigError
from vllm_ainfer_pd.plugin import registration_problem


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--additional-config", type=json.loads, default=None,
                        help="JSON for our engine only, e.g. "
                             "'{\"ainfer_pd\": {\"p_lane_min_tokens\": 32}}'")
    parser.add_argument("--load-format", default=None, help="both engines, e.g. dummy")
    parser.add_argument("--attention-backend", default=None,
                        help="both engines, vLLM's name, e.g. FLASHINFER (default: vLLM's "
                             "choice); a backend the lane refuses is recorded as refused")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="both engines: no torch.compile, no CUDA graphs (diagnosis)")
    parser.add_argument("--compilation-config", type=json.loads, default=None,
                        help="JSON for both engines, e.g. "
                             "'{\"pass_config\": {\"fuse_allreduce_rms\": false}}'")
    parser.add_argument("--long-prompts", action="store_true",
                        help="prompts of up to 1,500 tokens, turns adding 536-655 (parity_waves)")
    parser.add_argument("--control", choices=["tail"], default=None,
                        help="no ainfer_pd engine: compare stock with stock computing each "
                             "prompt's last token in a later step (prompt[:-1] first, prefix "
                             "cache reset in between), as the P lane does (offline TP layouts)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON for both engines (offline TP layouts), e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'; "
                             "the report then has each engine's draft and acceptance counts")
    # Served layouts (--dp > 1): a reference other than stock, e.g. the backend's mode=normal with a
    # single-mode DeepEP backend against phase-owned DeepEP (gpu_run.sh dp2deepep).
    parser.add_argument("--reference-additional-config", type=json.loads, default=None,
                        help="served: the reference runs ainfer_pd with this JSON, e.g. "
                             "'{\"ainfer_pd\": {\"mode\": \"normal\"}}' (default: stock vLLM)")
    parser.add_argument("--reference-flags", default="",
                        help="served: more `vllm serve` flags for the reference only")
    parser.add_argument("--ours-flags", default="",
                        help="served: more `vllm serve` flags for ours only, e.g. "
                             "'--all2all-backend deepep_low_latency'")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    # A wall-clock limit (`timeout`) sends SIGTERM: unwind, so the `vllm serve` process groups
    # (started with setsid, out of reach of `timeout`) are stopped and the report is still written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    result: dict = {"argv": vars(args), "attention_backend": args.attention_backend}
    try:
        problem = None if args.control else registration_problem()
        if problem is not None:  # vLLM would fail inside VllmConfig, naming nothing of ours
            raise RuntimeError(f"the ainfer_pd plugin would not load in vLLM: {problem}")
        if args.dp > 1:
            serve_parity(args, result)
        else:
            offline_parity(args, result)
    except ConfigError as exc:  # the backend refused this configuration at start, in one line
        result["refused"] = str(exc)
        print(f"refused: {exc}", flush=True)
    except BaseException as exc:  # the report is still written, with what failed and where
        result["error"] = repr(exc)
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(summary(result), flush=True)
    return 1 if "error" in result else 2 if "refused" in result else 0


def summary(result: dict) -> str:
    head = (f"parity: exact={result.get('exact')} tie={result.get('tie')} "
            f"fail={result.get('fail')}")
    if result.get("attention_backend"):
        head += f" attention_backend={result['attention_backend']}"
    if "refused" in result:
        head += f" REFUSED {result['refused']}"
    if "error" in result:
        head += f" ERROR {result['error'][:300]}"
    lanes = result.get("ours_workers_after") or []
    for rank in lanes:
        lane = rank.get("p_lane") or {}
        head += (f"\n  rank {rank.get('rank')}: jobs_done={lane.get('jobs_done')} "
                 f"failed={lane.get('jobs_failed')} epochs={lane.get('epochs')} "
                 f"segments={lane.get('segments')} after_d={lane.get('segments_after_d')} "
                 f"p_tokens={lane.get('p_tokens')} inflight={lane.get('inflight')} "
                 f"p_workspace_bytes={rank.get('p_workspace_bytes')} "
                 f"attention_backends={rank.get('attention_backends')}")
    for engine in ("stock", "ours"):
        if f"{engine}_spec_decode" in result:
            head += f"\n  {engine} speculative decoding: {result[f'{engine}_spec_decode']}"
    for name, value in sorted((result.get("ours_lane_metrics") or {}).items()):
        head += f"\n  {name} {value}"
    return head


def versions(extra: dict | None = None) -> dict:
    import torch
    import vllm

    out = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out.update(nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    return {**out, **(extra or {})}


def offline_parity(args, result: dict) -> None:
    from vllm import LLM

    from ainfer_pd_testing.parity import LLMRunner, compare, parity_waves, run_waves, stock_alone

    engine_args = dict(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tp,
                       max_model_len=2048, max_num_seqs=32, gpu_memory_utilization=0.3, seed=0,
                       disable_custom_all_reduce=args.disable_custom_all_reduce,
                       enforce_eager=args.enforce_eager)
    if args.load_format:
        engine_args["load_format"] = args.load_format
    if args.attention_backend:
        engine_args["attention_backend"] = args.attention_backend
    if args.compilation_config is not None:
        engine_args["compilation_config"] = args.compilation_config
    if args.speculative_config is not None:
        engine_args.update(speculative_config=args.speculative_config, disable_log_stats=False)
    ours_args = dict(engine_args, distributed_executor_backend="ainfer_pd")
    if args.additional_config is not None:
        ours_args["additional_config"] = args.additional_config
    waves = parity_waves(vocab_size=512, long=args.long_prompts)
    prompts = [p for w in waves for p in w]
    result.update(versions=versions(), engine_args=engine_args,
                  ours_additional_config=args.additional_config)
    if args.attention_backend:
        # Build our engine's config first: a backend the lane refuses is refused there, before
        # either engine starts.
        from vllm.engine.arg_utils import EngineArgs

        EngineArgs(**ours_args).create_engine_config()
    t0 = time.time()
    stock_llm = LLM(**engine_args)
    stock = LLMRunner(stock_llm)
    result["stock_start_s"] = time.time() - t0
    t0 = time.time()
    stock_out = run_waves(stock, waves, args.max_tokens)
    result["stock_waves_s"] = time.time() - t0
    if args.control == "tail":
        stock_llm.reset_prefix_cache()
        t0 = time.time()
        control_out = []
        for wave in waves:
            stock.generate([p[:-1] for p in wave if len(p) > 1], 1)
            control_out += stock.generate(wave, args.max_tokens)
        result["control_waves_s"] = time.time() - t0
        report = compare(prompts, stock_out, control_out, stock.teacher_force)
        stock_llm.llm_engine.engine_core.shutdown()
        result.update(control="tail", exact=report.exact, tie=report.tie, fail=report.fail,
                      details=report.details)
        print(report, flush=True)
        return
    t0 = time.time()
    ours_llm = LLM(**ours_args)
    ours = LLMRunner(ours_llm)
    result["ours_start_s"] = time.time() - t0
    result["ours_workers"] = ours.worker_status()
    try:
        t0 = time.time()
        ours_out = run_waves(ours, waves, args.max_tokens)
        result["ours_waves_s"] = time.time() - t0
        result["ours_workers_after"] = ours.worker_status()  # the lane's counters per rank
        if args.speculative_config is not None:
            result["ours_spec_decode"] = ours.spec_decode_counts()
        for rank in result["ours_workers_after"]:
            lane = rank.get("p_lane") or {}
            if lane.get("jobs_done") and rank.get("p_workspace_bytes") == 0:
                raise RuntimeError(  # P's MoE would have shared D's scratch buffers
                    f"rank {rank.get('rank')}: P ran {lane['jobs_done']} jobs, but its own "
                    f"workspace manager holds 0 bytes")
    finally:
        ours_llm.llm_engine.engine_core.shutdown()
    if args.speculative_config is not None:  # before teacher forcing adds its own steps
        result["stock_spec_decode"] = stock.spec_decode_counts()
    report = compare(prompts, stock_out, ours_out, stock.teacher_force)
    alone = stock_alone(stock, prompts, stock_out, ours_out, report.failed, args.max_tokens)
    stock_llm.llm_engine.engine_core.shutdown()
    record(result, report, alone)


def lane_metrics(url: str) -> tuple[dict[str, float], list[str]]:
    """The `vllm_ainfer_pd_*` series of the server's `/metrics`: summed over label sets by name,
    and the raw lines (one per engine and rank)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("vllm_ainfer_pd_")]
    summed: dict[str, float] = {}
    for line in lines:
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        try:
            summed[name] = summed.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return summed, lines


def serve_parity(args, result: dict) -> None:
    from ainfer_pd_testing.parity import ServerRunner, compare, parity_waves, run_waves, stock_alone

    flags = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", "32",
             "--gpu-memory-utilization", "0.3", "--seed", "0", "--tensor-parallel-size",
             str(args.tp), "--data-parallel-size", str(args.dp), "--enable-expert-parallel"]
    if args.disable_custom_all_reduce:
        flags.append("--disable-custom-all-reduce")
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.load_format:
        flags += ["--load-format", args.load_format]
    if args.attention_backend:
        flags += ["--attention-backend", args.attention_backend]
    if args.compilation_config is not None:
        flags += ["--compilation-config", json.dumps(args.compilation_config)]
    ours_flags = flags + ["--distributed-executor-backend", "ainfer_pd"]
    if args.additional_config is not None:
        ours_flags += ["--additional-config", json.dumps(args.additional_config)]
    ours_flags += shlex.split(args.ours_flags)
    reference_flags = flags + shlex.split(args.reference_flags)
    if args.reference_additional_config is not None:
        reference_flags += ["--distributed-executor-backend", "ainfer_pd", "--additional-config",
                            json.dumps(args.reference_additional_config)]
    waves = parity_waves(vocab_size=512, long=args.long_prompts)
    prompts = [p for w in waves for p in w]
    result.update(versions=versions(), flags=reference_flags, ours_flags=ours_flags)
    log_dir = os.environ.get("GPU_PARITY_LOG_DIR")
    stock_srv = _server(args.model, reference_flags, "stock", log_dir)
    try:
        stock_srv.start()
        stock = ServerRunner(stock_srv.url, args.model)
        t0 = time.time()
        stock_out = run_waves(stock, waves, args.max_tokens)
        result["stock_waves_s"] = time.time() - t0
        ours_srv = _server(args.model, ours_flags, "ours", log_dir)
        try:
            ours_srv.start()
            t0 = time.time()
            ours_out = run_waves(ServerRunner(ours_srv.url, args.model), waves, args.max_tokens)
            result["ours_waves_s"] = time.time() - t0
            result["ours_lane_metrics"], result["ours_lane_metric_lines"] = (
                lane_metrics(ours_srv.url))
            result["ours_log_has_ainfer_worker"] = "AInferPDScheduler" in ours_srv.log_text()
        finally:
            ours_srv.stop()
        report = compare(prompts, stock_out, ours_out, stock.teacher_force)
        alone = stock_alone(stock, prompts, stock_out, ours_out, report.failed, args.max_tokens)
    finally:
        stock_srv.stop()
    record(result, report, alone)


def record(result: dict, report, alone: list[dict]) -> None:
    """The verdict, and for each failure whether stock alone gives our tokens (its own batch
    sensitivity, `parity.stock_alone`; a diagnosis that leaves the counts as they are)."""
    result.update(exact=report.exact, tie=report.tie, fail=report.fail, details=report.details,
                  failed_stock_alone=alone)
    print(report, flush=True)
    for a in alone:
        print(f"  #{a['prompt']} on stock alone: "
              + ("our tokens (stock's own output depends on its batch)" if a["stock_alone_is_ours"]
                 else "stock's batched tokens" if a["stock_alone_is_stock"]
                 else "a third output (stock's own output depends on its batch)"), flush=True)


def _server(model: str, flags: list[str], name: str, log_dir: str | None):
    """A `VllmServer` whose log goes to `log_dir` (the GPU machine's log folder) when given, so
    it survives a run killed at its time limit."""
    from pathlib import Path

    from vllm_ainfer_pd.rollout.server import VllmServer

    server = VllmServer(model, flags, name=name)
    if log_dir:
        server.log_path.unlink(missing_ok=True)
        server.log_path = Path(log_dir) / f"serve-{result_name(name)}.log"
    return server


def result_name(name: str) -> str:
    return f"{os.environ.get('GPU_PARITY_JOB', 'dp')}-{name}"


if __name__ == "__main__":
    raise SystemExit(main())
