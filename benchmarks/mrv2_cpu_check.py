"""Stock vLLM's Model Runner V2 on the CPU, through Triton's interpreter, against its V1 runner.

    python benchmarks/mrv2_cpu_check.py [--tp 1 2] [--out benchmarks/results/cpu/mrv2_stock.json]

For each TP size, two engines of stock vLLM (no ainfer_pd) on the tiny model, float32, eager:
the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) and Model Runner V2 with
`ainfer_pd_testing/mrv2_cpu/` first on PYTHONPATH (its docstring says what it changes). Each
generates 4 prompts x 16 greedy tokens twice and reports its runner class (asked of every
worker), its start time and the second generation's time. Exits 1 unless every engine reports
the runner it was asked for and V2's tokens equal V1's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ainfer_pd_testing.model_runner_v2 import v2_env  # noqa: E402

PROMPTS = [[5, 17, 99, 250, 31, 8], [400, 12, 77], [3, 3, 3, 3, 90, 120, 61, 7, 7], [250] * 12]
MAX_TOKENS = 16


def _runner_class(worker) -> str:
    cls = type(worker.model_runner)
    return f"{cls.__module__}.{cls.__qualname__}"


def child(tp: int) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_ainfer_pd.models import ensure_model
    from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, apply_cpu_env

    apply_cpu_env(tp)
    start = time.monotonic()
    llm = LLM(model=str(ensure_model("tiny")), **{**CPU_ENGINE_ARGS, "tensor_parallel_size": tp,
                                                   "distributed_executor_backend": "mp"})
    started = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    again = time.monotonic()
    second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    done = time.monotonic()
    return {"runners": llm.collective_rpc(_runner_class), "start_s": round(started - start, 1),
            "generate_s": round(done - again, 2), "tokens": first, "repeats": first == second}


def run(runner: str, tp: int) -> dict:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "VLLM_USE_V2_MODEL_RUNNER": "0",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if runner == "v2":
        env = v2_env(env)
    proc = subprocess.run([sys.executable, __file__, "--child", str(tp)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{runner} TP={tp} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return 0
    rows, ok = [], True
    for tp in args.tp:
        v1, v2 = run("v1", tp), run("v2", tp)
        same = v1["tokens"] == v2["tokens"]
        runners_ok = (all(r.startswith("vllm.v1.worker.cpu_model_runner.") for r in v1["runners"])
                      and all(r.startswith("vllm.v1.worker.cpu.model_runner.")
                              for r in v2["runners"]))
        ok = ok and same and runners_ok and v1["repeats"] and v2["repeats"]
        rows.append({"tp": tp, "v1": v1, "v2": v2, "v2_tokens_equal_v1": same})
        print(f"TP={tp}: V1 {v1['runners'][0]} start {v1['start_s']} s, generate "
              f"{v1['generate_s']} s; V2 {v2['runners'][0]} start {v2['start_s']} s, generate "
              f"{v2['generate_s']} s; tokens equal: {same}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                        "rows": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
