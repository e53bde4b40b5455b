"""vLLM's own tests, stock against `ainfer_pd`: a differential run of vLLM 0.26.0's test suite.

    python benchmarks/vllm_tests.py                      # both runs, table into the results
    python benchmarks/vllm_tests.py --break drop-token   # the negative control (see below)
    make vllm-tests
    # another release (its environment's python): the core modules, beside 0.26's rate on them
    python benchmarks/vllm_tests.py --core --out benchmarks/results/vllm_tests/vllm-0.32.0 \
        --beside benchmarks/results/vllm_tests/results.json
    # the same on Model Runner V2, beside 0.32's V1-runner rate
    python benchmarks/vllm_tests.py --core --model-runner-v2 \
        --out benchmarks/results/vllm_tests/vllm-0.32.0-mrv2 \
        --beside benchmarks/results/vllm_tests/vllm-0.32.0/results.json

Fetches vLLM's source distribution through pip (cached, `ainfer_pd_testing/vllm_suite/run.py`),
takes the installed vLLM release's `tests/` (nothing of it is copied into this repository) and
runs `MODULES` twice, one pytest process each: stock vLLM, then `ainfer_pd` injected as executor
backend into every engine the tests build, with the P lane taking every prompt of >= 4 uncached
tokens (`ainfer_pd_testing/vllm_suite/`). The hub model names the tests load are the embedded tiny
model in both runs. A test counts only where stock passes. Writes `results.json` and `README.md`
(the table, every difference with its cause) into `--out`.

`--break drop-token` runs only `ours`, with a lane that prefills every prompt with its first token
dropped (a harness patch, not the product), and compares it with the stored stock results: vLLM's
tests must catch it. Written to `negative_control.json` / `.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

# The test harness (ainfer_pd_testing) is not installed with the package: import it from this
# checkout, with or without the package installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ainfer_pd_testing.model_runner_v2 import v2_env  # noqa: E402
from ainfer_pd_testing.vllm_suite import hooks  # noqa: E402
from ainfer_pd_testing.vllm_suite.run import (  # noqa: E402
    VLLM_VERSION,
    cache_dir,
    fetch_sdist,
    run_suite,
    sha256,
)

OUT = Path(__file__).resolve().parent / "results" / "vllm_tests"

# Modules whose tests build engines (most share one per module): generation and sampling
# parameters, logprobs, stop strings, min/max tokens, n > 1, beam search, prompt validation, the
# offline `LLM` API, `collective_rpc`, async scheduling, the OpenAI server.
MODULES = [
    "tests/entrypoints/llm/test_generate.py",
    "tests/entrypoints/llm/test_chat.py",
    "tests/entrypoints/llm/test_collective_rpc.py",
    "tests/entrypoints/llm/test_prompt_validation.py",
    "tests/entrypoints/llm/test_gpu_utilization.py",
    "tests/samplers",
    "tests/v1/sample/test_sampling_params_e2e.py",
    "tests/v1/sample/test_logprobs.py",
    "tests/detokenizer",
    "tests/v1/engine/test_llm_engine.py",
    "tests/v1/engine/test_parallel_sampling.py",
    "tests/v1/e2e/general/test_min_tokens.py",
    "tests/v1/e2e/general/test_async_scheduling.py",
    "tests/v1/e2e/general/test_context_length.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/completion/test_prompt_validation.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
    "tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/completion/test_completion_with_prompt_embeds.py",
    "tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py",
    "tests/v1/engine/test_abort_final_step.py",
    "tests/v1/engine/test_preprocess_error_handling.py",
    "tests/v1/logits_processors/test_custom_offline.py",
    "tests/v1/metrics/test_engine_logger_apis.py",
    "tests/entrypoints/openai/completion/test_shutdown.py",
    "tests/entrypoints/anthropic/test_messages.py",
    "tests/entrypoints/generate/generative_scoring/test_generative_scoring_e2e.py",
    "tests/v1/logits_processors/test_custom_online.py",
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    # vLLM's batch runner (`vllm run-batch`), the server's other endpoints and middleware, the
    # collective RPC and weight-transfer APIs (RL frameworks' paths), long prompts in chunks, and
    # engines that fail or shut down.
    "tests/entrypoints/openai/test_run_batch.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/entrypoints/serve/instrumentator/test_basic.py",
    "tests/entrypoints/serve/instrumentator/test_orca_metrics.py",
    "tests/entrypoints/serve/instrumentator/test_http_status_metrics.py",
    "tests/entrypoints/serve/dev/rpc/test_collective_rpc.py",
    "tests/entrypoints/weight_transfer/test_weight_transfer_llm.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_uds.py",
    "tests/entrypoints/openai/test_async_tokenization.py",
    "tests/entrypoints/openai/completion/test_token_in_token_out.py",
    "tests/entrypoints/openai/chat_completion/test_root_path.py",
    "tests/entrypoints/openai/test_render_token_offsets.py",
    "tests/v1/engine/test_iteration_logging.py",
    "tests/v1/engine/test_init_error_messaging.py",
    "tests/v1/engine/test_fast_incdec_prefix_err.py",
    "tests/v1/shutdown",
    "tests/test_regression.py",
    "tests/entrypoints/llm/offline_mode/test_offline_mode.py",
    # Chunked prefill and prefix-cache hits against a full prefill (the CPU platform's own e2e
    # test), vLLM against transformers, and structured outputs.
    "tests/v1/e2e/test_cpu_linear_attn_chunked_prefix.py",
    "tests/basic_correctness/test_basic_correctness.py",
    "tests/entrypoints/llm/test_struct_output_generate.py",
    # The scheduler end to end (partial prefills, prefix-cache stats, a prefix-cache reset with
    # requests running), AsyncLLM's config reducer, an fp32 LM head, OpenTelemetry traces, the
    # token-in/token-out generate endpoint, several API servers on one engine, SageMaker's
    # handlers and middleware, reasoning and tool-calling parsers on a live server.
    "tests/v1/core/test_scheduler_e2e.py",
    "tests/v1/core/test_reset_prefix_cache_e2e.py",
    "tests/config/test_mp_reducer.py",
    "tests/v1/sample/test_head_dtype.py",
    "tests/v1/tracing/test_tracing.py",
    "tests/entrypoints/scale_out/token_in_token_out/test_serving_tokens.py",
    "tests/entrypoints/openai/test_multi_api_servers.py",
    "tests/entrypoints/serve/sagemaker/test_sagemaker_middleware_integration.py",
    "tests/entrypoints/serve/sagemaker/test_sagemaker_handler_overrides.py",
    "tests/entrypoints/openai/chat_completion/test_include_reasoning.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/chat_completion/test_thinking_token_budget.py",
]

# A short set (about 15 minutes a run on 2 cores): the offline API, sampling parameters, stop
# reasons, min tokens, context length, the engine, the OpenAI server's completions and chats,
# token ids and logprobs, the scheduler end to end, a prefix-cache reset, collective RPC,
# tokenization, chunked prompts and async scheduling.
CORE = [
    "tests/entrypoints/llm/test_generate.py",
    "tests/entrypoints/llm/test_chat.py",
    "tests/entrypoints/llm/test_prompt_validation.py",
    "tests/entrypoints/llm/test_gpu_utilization.py",
    "tests/v1/sample/test_sampling_params_e2e.py",
    "tests/detokenizer/test_stop_reason.py",
    "tests/v1/e2e/general/test_min_tokens.py",
    "tests/v1/e2e/general/test_context_length.py",
    "tests/v1/engine/test_llm_engine.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
    "tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/v1/core/test_scheduler_e2e.py",
    "tests/v1/core/test_reset_prefix_cache_e2e.py",
    "tests/entrypoints/serve/dev/rpc/test_collective_rpc.py",
    "tests/entrypoints/serve/tokenize/test_tokenization.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/v1/e2e/general/test_async_scheduling.py",
]

# Tests of the chosen modules left out, with why (node ids or prefixes).
DESELECT: dict[str, str] = {}

# Left out whole, with why (written into the results).
LEFT_OUT = {
    "tests/v1/sample/test_logprobs_e2e.py": "GSM8K accuracy through lm_eval (a data set download)",
    "tests/v1/engine/test_async_llm.py, test_engine_core.py, test_engine_core_client.py, "
    "tests/v1/e2e/general/test_streaming_input.py":
        "skip themselves off CUDA at import ('V1 currently only supported on CUDA')",
    "tests/entrypoints/openai/responses/": "a 18,192-token context (the tiny model has 4,096)",
    "tests/entrypoints/openai/chat_completion/test_chat.py, test_return_tokens_as_ids.py":
        "serve LoRA adapters from the hub (LoRA is refused with the lane)",
    "tests/entrypoints/openai/completion/test_completion_error.py, chat_completion/"
    "test_chat_error.py, test_serving_chat.py, test_stop_token_ids.py":
        "a mocked engine or no engine: the backend is not involved",
    "tests/entrypoints/serve/dev/test_sleep.py": "sleep mode needs CUDA's memory allocator "
    "(vLLM has no sleep mode on the CPU); the backend's sleep and wake are covered on the H200",
    "tests/entrypoints/serve/instrumentator/test_optional_middleware.py": "an embedding model "
    "(pooling; no generation)",
    "tests/entrypoints/openai/chat_completion/test_extra_content_fields.py": "a multimodal "
    "model (translategemma)",
    "tests/v1/sample/test_sampler.py, test_topk_topp_sampler.py, test_rejection_sampler.py, "
    "test_batched_count_greater_than.py": "unit tests of sampler kernels: no engine is built, so "
    "the backend is not involved",
    "tests/v1/executor/test_executor.py": "the tests bring their own executor class (or none), "
    "which the run leaves as asked: ainfer_pd is not involved",
    "tests/v1/e2e/general/test_cascade_attention.py": "FLASH_ATTN / FLASHINFER attention "
    "backends (CUDA)",
    "tests/entrypoints/openai/test_return_routed_experts.py, tests/entrypoints/scale_out/"
    "token_in_token_out/test_return_routed_experts.py": "assert tiny-mixtral's shape (2 layers, "
    "top-2 of 8 experts); the tiny model has 4 layers, top-4 of 16",
    "tests/entrypoints/scale_out/derender/test_derender_parity.py": "the deepseek_r1 reasoning "
    "parser needs <think> tokens, which the tiny model's tokenizer has not",
    "tests/entrypoints/openai/models/test_models.py, tests/entrypoints/serve/sagemaker/"
    "test_sagemaker_stateful_sessions.py, test_sagemaker_lora_adapters.py, "
    "tests/entrypoints/tool_parsers/test_hermes_tool_parser.py": "LoRA adapters from the hub",
    "tests/tool_use/, tests/entrypoints/tool_parsers/test_granite4_tool_parser.py, "
    "test_openai_tool_parser.py": "real models (8B and up, gpt-oss) that must call tools",
    "tests/entrypoints/openai/test_openai_schema.py": "a multimodal model (SmolVLM)",
    "tests/v1/streaming_input/test_async_llm_streaming.py, tests/entrypoints/scale_out/"
    "token_in_token_out/test_generate_stream.py, tests/entrypoints/serve/tokenize/"
    "test_serving_tokenization.py": "a mocked engine: the backend is not involved",
    "tests/basic_correctness/test_mem.py, tests/v1/determinism/": "CUDA memory / CUDA only",
}

# Why a test that passes on stock does not pass on ours (filled in from the runs' diagnoses).
CAUSES: dict[str, str] = {
    # Limitations of the backend (stock passes, ours fails).
    "tests/v1/logits_processors/test_custom_offline.py::test_rejects_custom_logitsprocs["
    "CustomLogitprocSource.LOGITPROC_SOURCE_ENTRYPOINT-spec_dec]":
        "limitation: the test asks for vLLM's in-process executor "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, no backend) and then reads its worker "
        "(`llm.llm_engine.model_executor.driver_worker`); ainfer_pd's workers always run in "
        "processes of their own (it is vLLM's MultiprocExecutor underneath), so the executor has "
        "no `driver_worker`",
    "tests/entrypoints/serve/instrumentator/test_metrics.py::test_metrics_counts[":
        "limitation (documented in docs/rollout.md, Metrics): vllm:iteration_tokens_total counts "
        "the tokens of D's steps; the prompt tokens the P lane computes in the background are "
        "KV-connector tokens to vLLM and are not in any step (expected 360, found 110: the "
        "prompts' tokens are missing)",
    "tests/v1/core/test_reset_prefix_cache_e2e.py::test_reset_prefix_cache_e2e":
        "limitation (docs/planner.md, Pausing with P in flight): the test calls "
        "`reset_prefix_cache(reset_running_requests=True)` with P in flight and no pause; vLLM "
        "preempts `running`, but a request parked in WAITING_FOR_REMOTE_KVS keeps the blocks "
        "its P job may still write until the job drained, which takes engine steps a reset "
        "inside one call cannot make, and vLLM raises its own error for requests waiting for "
        "KV ('...not supported yet'); pausing first empties the lane",
    # Stock fails, ours passes.
    "tests/entrypoints/serve/instrumentator/test_metrics.py::test_abort_metrics_reset[":
        "stock: timing; the test waits at most 10 s for running_requests > 0 while its "
        "requests ran (its other parametrizations pass on stock); not a backend difference",
    "tests/v1/sample/test_logprobs.py::test_get_logprobs_and_prompt_logprobs[False-2.0-":
        "stock: a vLLM bug on the CPU: a seeded request whose prompt is prefilled in chunks "
        "(the test's max_num_batched_tokens=16) rewinds its torch.Generator with get_offset() "
        "(gpu_model_runner._bookkeeping_sync), which CPU generators lack ('CPU Generator does "
        "not use offset'), and the engine dies; ours: the P lane prefills the prompt outside "
        "D's steps, so no partial prefill reaches that rewind",
}

# The slice `make test` runs (tests/test_vllm_suite.py): one shared engine per module, a few
# minutes on 2 cores.
SLICE = [
    "tests/v1/sample/test_sampling_params_e2e.py",
]


def cause_of(nodeid: str) -> str:
    for key, cause in CAUSES.items():
        if nodeid.startswith(key):
            return cause
    return "not diagnosed"


def compare(stock: dict, ours: dict) -> dict:
    """Per test both outcomes. Counted: stock passes and an engine was built or computed during
    the test (one that passes without, e.g. one that skips itself in a subprocess, proves nothing
    of the backend)."""
    tests = sorted(set(stock) | set(ours))
    absent = {"outcome": "absent", "message": "", "engines": 0, "steps": 0, "lane_jobs": 0}
    rows = []
    for t in tests:
        s, o = stock.get(t, absent), ours.get(t, absent)
        rows.append({"test": t, "stock": s["outcome"], "ours": o["outcome"],
                     # The same test code in both runs: either run's record shows it.
                     "engine": sum(r.get(k, 0) for r in (s, o) for k in ("engines", "steps")) > 0,
                     "ours_steps": o.get("steps", 0),
                     "lane_jobs": o.get("lane_jobs", 0), "stock_message": s["message"],
                     "ours_message": o["message"]})
    stock_passed = [r for r in rows if r["stock"] == "passed"]
    counted = [r for r in stock_passed if r["engine"]]
    passed = [r for r in counted if r["ours"] == "passed"]
    return {
        "rows": rows,
        "tests": len(rows),
        "stock": dict(Counter(r["stock"] for r in rows)),
        "ours": dict(Counter(r["ours"] for r in rows)),
        "stock_passed_without_engine": [r["test"] for r in stock_passed if not r["engine"]],
        "counted": len(counted),
        "ours_passed": len(passed),
        "ours_passed_with_lane_jobs": sum(1 for r in passed if r["lane_jobs"] > 0),
        "pass_rate": round(len(passed) / len(counted), 4) if counted else None,
        "differences": [r for r in rows if r["stock"] != r["ours"]],
    }


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def counted_on(rows: list[dict], modules: list[str]) -> tuple[int, int]:
    """(counted, ours passed) over the tests of `modules` (paths of files or folders)."""
    def inside(nodeid: str) -> bool:
        module = module_of(nodeid)
        return any(module == m or module.startswith(m.rstrip("/") + "/") for m in modules)

    counted = [r for r in rows if inside(r["test"]) and r["stock"] == "passed" and r["engine"]]
    return len(counted), sum(1 for r in counted if r["ours"] == "passed")


def beside_line(path: Path, meta: dict, summary: dict) -> str:
    """Another release's stored results over the same modules, as one line of the report."""
    other = json.loads(path.read_text())
    rows = compare(other["runs"]["stock"], other["runs"]["ours"])["rows"]
    counted, passed = counted_on(rows, meta["modules"])
    here = counted_on(summary["rows"], meta["modules"])
    rate = f"{100 * passed / counted:.1f}%" if counted else "-"
    return (f"- the same modules on vLLM {other['meta']['vllm_version']} (`{path}`): counted "
            f"{counted}, ours passes {passed} = {rate}; here: counted {here[0]}, ours passes "
            f"{here[1]}")


def markdown(summary: dict, meta: dict, title: str) -> str:
    lines = [f"# {title}", "",
             f"vLLM {meta['vllm_version']} (sdist sha256 `{meta['sdist_sha256'][:16]}...`), "
             f"`python benchmarks/vllm_tests.py` on {meta['machine']}, {meta['date']}.", ""]
    merges = meta.get("merges", [])
    if merges:
        modules = ", ".join(f"`{m}`" for m in dict.fromkeys(
            m for merge in merges for m in merge["modules"]))
        dates = ", ".join(dict.fromkeys(merge["date"] for merge in merges))
        lines += [f"Run again or added later ({dates}; `--merge --modules ...`, both runs, in "
                  f"place of the earlier results; the last pass of each counts): {modules}.", ""]
    lines += ["ours: `ainfer_pd` as executor backend of every engine (by its class path "
              "`vllm_ainfer_pd.executor.AInferPDExecutor` in a process where a test hides vLLM's "
              "plugins), "
             f"`additional_config={{\"ainfer_pd\": {{\"p_lane_min_tokens\": "
             f"{hooks.P_LANE_MIN_TOKENS}}}}}`; both runs: the tiny model for every hub name, "
             "float32 or the test's dtype, `enforce_eager`, 1 GiB of KV cache on the CPU, "
             "`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` (tests that ask for 8,192-token contexts; the "
             "tiny model has 4,096 positions).", ""]
    lines += [f"- tests collected: {summary['tests']}; stock {summary['stock']}; "
              f"ours {summary['ours']}",
              f"- stock passes without building or stepping an engine (not counted): "
              f"{len(summary['stock_passed_without_engine'])}",
              f"- **counted (stock passes, with an engine): {summary['counted']}; ours "
              f"passes "
              f"{summary['ours_passed']} = {100 * (summary['pass_rate'] or 0):.1f}%**; "
              f"of these, {summary['ours_passed_with_lane_jobs']} ran P-lane jobs",
              f"- wall time (every run, merges included): stock "
              f"{meta['wall_s'].get('stock', 0):.0f} s, ours "
              f"{meta['wall_s'].get('ours', 0):.0f} s",
              *([beside_line(Path(meta["beside"]), meta, summary)] if meta.get("beside") else []),
              ""]
    lines += ["| module | tests | counted | ours pass (of counted) | lane jobs |",
              "|---|---|---|---|---|"]
    by_module: dict[str, list] = {}
    for r in summary["rows"]:
        by_module.setdefault(module_of(r["test"]), []).append(r)
    for mod, rows in sorted(by_module.items()):
        sp = [r for r in rows if r["stock"] == "passed" and r["engine"]]
        op = [r for r in sp if r["ours"] == "passed"]
        lines.append(f"| `{mod}` | {len(rows)} | {len(sp)} | {len(op)} | "
                     f"{sum(r['lane_jobs'] for r in rows)} |")
    lines += ["", "## Differences", ""]
    if not summary["differences"]:
        lines.append("None.")
    else:
        lines += ["| test | stock | ours | cause | ours' error |", "|---|---|---|---|---|"]
        for r in summary["differences"]:
            msg = (r["ours_message"] or r["stock_message"]).replace("|", "\\|")[:200]
            lines.append(f"| `{r['test']}` | {r['stock']} | {r['ours']} | "
                         f"{cause_of(r['test'])} | {msg} |")
    lines += ["", "## Left out", ""]
    lines += [f"- `{k}`: {v}" for k, v in LEFT_OUT.items()]
    lines += [f"- `{k}`: {v}" for k, v in DESELECT.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="*", default=None, help="test paths (default MODULES)")
    parser.add_argument("--core", action="store_true", help="the CORE modules (a short run)")
    parser.add_argument("--model-runner-v2", action="store_true",
                        help="both runs' engines on vLLM's Model Runner V2 (vLLM 0.32 on; on the "
                        "CPU through Triton's interpreter, ainfer_pd_testing/model_runner_v2.py)")
    parser.add_argument("--beside", type=Path, default=None,
                        help="another release's results.json: its rate on the same modules "
                        "goes into the report")
    parser.add_argument("--runs", default="stock,ours", help="stock,ours (default) or one")
    parser.add_argument("--break", dest="broken", default=None, choices=["drop-token"])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--logs", type=Path, default=cache_dir() / f"runs-{VLLM_VERSION}",
                        help="pytest's output and per-module results (outside the checkout)")
    parser.add_argument("--timeout", type=int, default=600, help="per test, seconds")
    parser.add_argument("--resume", action="store_true",
                        help="keep the modules an interrupted run finished (<logs>/<run>/*.done)")
    parser.add_argument("--merge", action="store_true",
                        help="run only --modules, in both runs, and put their results in place "
                        "of those modules' in the stored results.json (the others' stay)")
    args = parser.parse_args()
    if args.merge and (not args.modules or args.runs != "stock,ours" or args.broken):
        parser.error("--merge needs --modules and both runs")
    if args.core and args.modules:
        parser.error("--core or --modules, not both")
    tests = CORE if args.core else args.modules or MODULES
    if args.model_runner_v2:
        os.environ.update(v2_env())  # inherited by every pytest process of both runs
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logs = args.logs
    meta = {"vllm_version": VLLM_VERSION, "sdist_sha256": sha256(fetch_sdist()),
            "modules": tests, "deselected": DESELECT, "machine": f"{os.cpu_count()} CPU cores",
            "date": time.strftime("%Y-%m-%d"), "wall_s": {}, "engines": {},
            **({"beside": str(args.beside)} if args.beside else {})}
    if args.broken:
        stock = json.loads((out / "results.json").read_text())["runs"]["stock"]
        run = run_suite("ours", tests, logs, broken=args.broken, deselect=list(DESELECT),
                        timeout_s=args.timeout, resume=args.resume)
        summary = compare({k: v for k, v in stock.items() if k in run.results}, run.results)
        meta["wall_s"]["ours"] = run.wall_s
        (out / "negative_control.json").write_text(json.dumps(
            {"meta": meta, "break": args.broken, "summary": summary}, indent=1))
        (out / "negative_control.md").write_text(markdown(
            summary, meta, f"Negative control: ours with `--break {args.broken}` against stock"))
        print(f"counted {summary['counted']}, ours passed {summary['ours_passed']}")
        full = json.loads((out / "results.json").read_text())
        write_results(out, full["meta"], full["runs"])  # the README gains the control's notes
        return
    modes = args.runs.split(",")
    runs = {mode: {} for mode in modes}
    engines: dict[str, Counter] = {mode: Counter() for mode in modes}
    meta["wall_s"] = {mode: 0.0 for mode in modes}
    if args.merge:
        meta, runs, engines = stored_without(out, tests, meta)
    # Module by module, each in both runs: an interrupted run leaves complete pairs (--resume).
    for test in tests:
        for mode in modes:
            run = run_suite(mode, [test], logs, deselect=list(DESELECT), timeout_s=args.timeout,
                            resume=args.resume)
            runs[mode].update(run.results)
            meta["wall_s"][mode] = round(meta["wall_s"][mode] + run.wall_s, 1)
            engines[mode].update(e.split(" model=")[0] for e in run.engines)
            print(f"{mode} {test}: {len(run.results)} tests in {run.wall_s:.0f} s, "
                  f"{dict(Counter(v['outcome'] for v in run.results.values()))}", flush=True)
        meta["engines"] = {mode: dict(c) for mode, c in engines.items()}
        if set(modes) == {"stock", "ours"}:
            write_results(out, meta, runs)
    if set(modes) != {"stock", "ours"}:
        (out / f"results_{'_'.join(modes)}.json").write_text(json.dumps(
            {"meta": meta, "runs": runs}, indent=1))


def stored_without(out: Path, tests: list[str], meta: dict) -> tuple[dict, dict, dict]:
    """The stored run's meta, results and engine counts, less the results of `tests` (module
    paths), which a merge runs again; the merge is recorded in the meta."""
    stored = json.loads((out / "results.json").read_text())
    if (stored["meta"]["vllm_version"], stored["meta"]["sdist_sha256"]) != \
            (meta["vllm_version"], meta["sdist_sha256"]):
        raise SystemExit("--merge: the stored results are of another vLLM source distribution")

    def rerun(nodeid: str) -> bool:  # a test of one of `tests` (a node id, a file, a folder)
        module = module_of(nodeid)
        return any(nodeid == p or module == p or module.startswith(p.rstrip("/") + "/")
                   for p in tests)

    runs = {mode: {t: r for t, r in results.items() if not rerun(t)}
            for mode, results in stored["runs"].items()}
    merged = dict(stored["meta"])
    merged["modules"] = list(merged["modules"]) + [t for t in tests if t not in merged["modules"]]
    merged.setdefault("merges", []).append({"modules": tests, "date": meta["date"]})
    engines = {mode: Counter(merged.get("engines", {}).get(mode, {})) for mode in runs}
    return merged, runs, engines


def write_results(out: Path, meta: dict, runs: dict) -> None:
    summary = compare(runs["stock"], runs["ours"])
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": {k: v for k, v in summary.items() if k != "rows"},
         "runs": runs}, indent=1))
    text = markdown(summary, meta, "vLLM's tests: stock vs ainfer_pd")
    (out / "README.md").write_text(text + negative_control_notes(out))
    print(f"counted {summary['counted']}, ours passed {summary['ours_passed']} "
          f"({100 * (summary['pass_rate'] or 0):.1f}%)", flush=True)


def negative_control_notes(out: Path) -> str:
    """The negative control's outcome, from `negative_control.json` when it has been run."""
    path = out / "negative_control.json"
    if not path.exists():
        return ""
    nc = json.loads(path.read_text())
    summary = nc["summary"]
    caught = [r for r in summary["differences"] if r["stock"] == "passed"]
    lines = ["", "## Negative control", "",
             f"`python benchmarks/vllm_tests.py --break {nc['break']} --modules "
             f"{' '.join(nc['meta']['modules'])}`: the P lane prefills every prompt with its "
             "first token dropped (a harness patch, `ainfer_pd_testing/vllm_suite/hooks.py`). "
             f"Of {summary['counted']} counted tests, {summary['ours_passed']} pass and "
             f"{len(caught)} fail: vLLM's tests catch it (`negative_control.md`).", ""]
    lines += [f"- `{r['test']}`: {r['ours_message'][:160]}" for r in caught[:12]]
    if len(caught) > 12:
        lines.append(f"- ... and {len(caught) - 12} more")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
