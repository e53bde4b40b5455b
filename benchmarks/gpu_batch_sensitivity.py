"""Does stock vLLM itself give one prompt different greedy tokens in different batches?

`gpu_pause.py` found one prompt of sixteen (prompt 7 of `prompts(4)`) where the lane's tokens
differ from stock's by a logprob gap of 0.1 after the test weight update, in some runs and not
others. A gap that large is no rounding tie of the output logits, but an MoE router whose top-k
is nearly tied upstream turns a rounding difference (another batch, other kernels) into one.
This runs the prompt on stock vLLM alone and in several batches, with the same engine arguments
and weights, and writes its tokens and top logprobs per batch: if stock's own tokens change with
the batch, the prompt sits on such a tie and no backend can be judged on it.

With `--router-margins` (and `--engine-args '{"enforce_eager": true}'`: module hooks do not fire in
compiled graphs) it also prefills the prompt and stock's first `--tokens-fed` output tokens once
more and records every MoE router's top-k margin per position
(`ainfer_pd_testing/router_probe.py`): the smallest margins say where a near-tie is, and how near.

    python3 benchmarks/gpu_batch_sensitivity.py --model .gpu/tiny --out probe.json [--update]
        [--router-margins --engine-args '{"enforce_eager": true}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
sys.path.insert(0, os.path.dirname(__file__))

from gpu_pause import MAX_TOKENS, SEED, prompts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=7, help="index into prompts(4)")
    parser.add_argument("--update", action="store_true", help="push gpu_pause.py's new weights")
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--router-margins", action="store_true")
    parser.add_argument("--tokens-fed", type=int, default=2,
                        help="stock's output tokens fed after the prompt for --router-margins "
                             "(2: the forward that computes output 2)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    from ainfer_pd_testing.router_probe import EXTENSION

    # --engine-args adds to these defaults and overrides them (e.g. a CPU run's smaller
    # gpu_memory_utilization).
    engine_args = {**dict(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=16,
                          max_num_batched_tokens=64, gpu_memory_utilization=0.3, seed=0,
                          enable_prefix_caching=False), **args.engine_args}
    llm = LLM(**engine_args, worker_extension_cls=EXTENSION)
    if args.update:
        llm.collective_rpc("perturb_weights", args=(SEED,))
    every = prompts(4)
    i = args.prompt
    batches = {"alone": [i], "all16": list(range(16)), "first8": list(range(8)),
               "last9": list(range(7, 16)), "pair_5": [5, i], "all16_again": list(range(16))}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    result: dict = {"engine_args": engine_args, "update": args.update, "prompt": i, "batches": {}}
    for name, members in batches.items():
        outs = llm.generate([TokensPrompt(prompt_token_ids=every[j]) for j in members], params,
                            use_tqdm=False)
        out = outs[members.index(i)].outputs[0]
        top = [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in out.logprobs[:4]]
        result["batches"][name] = {"tokens": list(out.token_ids), "top_logprobs_first4": top}
        print(name, list(out.token_ids)[:6], top[2], flush=True)
    distinct = {tuple(b["tokens"]) for b in result["batches"].values()}
    result["distinct_outputs"] = len(distinct)
    print("distinct outputs of prompt", i, "over", len(batches), "batches:", len(distinct))
    if args.router_margins:
        fed = every[i] + result["batches"]["all16"]["tokens"][:args.tokens_fed]
        result["router"] = router_margins(llm, fed)
        print("router margins:", json.dumps({k: v for k, v in result["router"].items()
                                              if k != "per_position_min"}), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    llm.llm_engine.engine_core.shutdown()
    return 0


def router_margins(llm, tokens: list[int]) -> dict:
    """One prefill of `tokens` with the routers hooked: the smallest top-k margins."""
    from ainfer_pd_testing.router_probe import prefill_router_margins

    rows = prefill_router_margins(llm, tokens)
    if not rows or any(len(r) < len(tokens) for r in rows):
        raise RuntimeError(f"router rows {[len(r) for r in rows]} < {len(tokens)} positions")
    margins = [(m, pos, layer) for layer, r in enumerate(rows) for pos, m in enumerate(r)
               if pos < len(tokens)]
    per_position = [min(r[pos] for r in rows) for pos in range(len(tokens))]
    return {
        "moe_layers": len(rows), "positions": len(tokens),
        "smallest": [{"margin": m, "position": p, "layer": lay}
                     for m, p, lay in sorted(margins)[:10]],
        "last_positions": {p: per_position[p] for p in range(len(tokens) - 3, len(tokens))},
        "below": {t: sum(m < t for m, _, _ in margins) for t in (1e-3, 1e-4, 1e-5, 1e-6)},
        "decisions": len(margins),
        "per_position_min": per_position,
    }


if __name__ == "__main__":
    sys.exit(main())
