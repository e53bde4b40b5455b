"""The physical floor of a rollout: the least time the hardware needs for the trace's
prefill compute and its decode memory traffic, to set a measured makespan against.

    python benchmarks/physical_floor.py --trace-preset gpu-small --model-preset gpu \\
        --tp 1 --dp 1 --peak-tflops 989 --hbm-tbps 4.8 [--makespan-s 412] [--json-out f.json]

The model, for a Qwen3-MoE config (every layer MoE, no shared experts):

- Requests. Turn k of a trajectory has prompt length `context` (all earlier increments and outputs
  plus its own increment), `new` = its increment (the rest is a prefix-cache hit) and `out` output
  tokens, each counted as one decode step.
- P FLOPs per request: 2 * active_params * new + 2 * hidden * vocab (the lm_head, one token per
  request) + attention scores 4 * heads * head_dim * layers * sum of keys seen, where the new token
  at position p (0-based) sees p + 1 keys (causal, the cached prefix included). Active params per
  token and layer: q, k, v, o projections + router + top_k experts x 3 matrices.
- D bytes. Decode runs as steps of a global batch of `decode_batch` tokens (all ranks together;
  default: the number of trajectories, since the replayer runs them all at once: the largest batch
  it can have, and the weight bytes per token only fall as the batch grows); there are
  sum(out) / decode_batch steps. Each step reads the dense weights (attention, router, lm_head)
  once per DP replica (TP shards them, DP replicates them) and, per layer, every expert the batch
  touches once (experts are split over all ranks): of E experts with top_k = k, a batch of b tokens
  touches E * (1 - (1 - k / E) ** b) on average. Each decoded token also reads its sequence's KV
  cache: 2 * layers * kv_heads * head_dim * dtype_bytes per token of context (the request's
  context + the tokens it decoded before).
- Left out (each only adds time): decode FLOPs, prefill weight and KV traffic, communication,
  imbalance between ranks. Both sums are divided over all ranks = tp * dp.
- floor = max(P FLOPs / (peak * ranks), D bytes / (hbm * ranks)) if P and D overlap perfectly;
  their sum is the floor if they run one after the other.
- Client-wait floor: no backend can finish a trajectory before its release time plus its client
  waits (x the replay's `--wait-scale`), whatever the hardware; the makespan's lower bound is the
  larger of that and the hardware floor. Where the client-wait floor is the larger, the trace
  measures latency more than throughput, and a backend's makespan can shrink only to it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_inter: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict) -> MoEShape:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("only configs whose every layer is MoE are supported "
                             "(mlp_only_layers=[] and decoder_sparse_step=1)")
        heads = cfg["num_attention_heads"]
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], heads,
                   cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                   cfg["vocab_size"])

    @property
    def dense_layer_params(self) -> int:
        """q, k, v, o projections and the router of one layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + self.hidden * self.experts

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through the decoder layers (lm_head apart)."""
        return self.layers * (self.dense_layer_params + self.top_k * self.expert_params)


def requests(trace) -> list[tuple[int, int, int]]:
    """(context, new, out) of every request of the trace."""
    return [(ctx, turn.input_tokens, turn.output_tokens) for t in trace.trajectories
            for ctx, turn in zip(t.contexts(), t.turns, strict=True)]


def prefill_flops(shape: MoEShape, context: int, new: int) -> int:
    keys = new * (2 * context - new + 1) // 2  # sum of p + 1 over positions context-new..context-1
    return (2 * shape.active_params * new + 2 * shape.hidden * shape.vocab
            + 4 * shape.heads * shape.head_dim * shape.layers * keys)


def decode_bytes(shape: MoEShape, reqs: list[tuple[int, int, int]], batch: float, dp: int,
                 dtype_bytes: int) -> dict[str, float]:
    """Weight and KV bytes of all decode steps, summed over all ranks."""
    steps = sum(out for _, _, out in reqs) / batch
    e, k = shape.experts, shape.top_k
    touched = e * (1 - (1 - k / e) ** batch)
    dense = dp * (shape.layers * shape.dense_layer_params + shape.hidden * shape.vocab)
    weights = steps * dtype_bytes * (dense + shape.layers * touched * shape.expert_params)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
    kv = kv_per_token * sum(out * ctx + out * (out - 1) // 2 for ctx, _, out in reqs)
    return {"steps": steps, "experts_touched_per_layer": touched, "weights": weights, "kv": kv}


def client_wait_floor(trace, wait_scale: float) -> float:
    """The latest trajectory end if every request took no time: release + scaled client waits."""
    return max(t.start_s + wait_scale * sum(turn.wait_s for turn in t.turns)
               for t in trace.trajectories)


def floor(trace, shape: MoEShape, tp: int, dp: int, dtype_bytes: int, decode_batch: float,
          peak_tflops: float, hbm_tbps: float, makespan_s: float | None = None,
          wait_scale: float = 1.0) -> dict:
    reqs = requests(trace)
    ranks = tp * dp
    p_flops = sum(prefill_flops(shape, ctx, new) for ctx, new, _ in reqs)
    d = decode_bytes(shape, reqs, decode_batch, dp, dtype_bytes)
    d_bytes = d["weights"] + d["kv"]
    p_s = p_flops / (peak_tflops * 1e12 * ranks)
    d_s = d_bytes / (hbm_tbps * 1e12 * ranks)
    out = {
        "inputs": {"shape": asdict(shape), "tp": tp, "dp": dp, "ranks": ranks,
                   "dtype_bytes": dtype_bytes, "decode_batch": decode_batch,
                   "peak_tflops": peak_tflops, "hbm_tbps": hbm_tbps, "makespan_s": makespan_s,
                   "wait_scale": wait_scale, "trace_meta": dict(trace.meta)},
        "counts": {"trajectories": len(trace.trajectories), "requests": len(reqs),
                   "new_prompt_tokens": sum(new for _, new, _ in reqs),
                   "prompt_tokens": sum(ctx for ctx, _, _ in reqs),
                   "output_tokens": sum(o for _, _, o in reqs)},
        "p_flops": p_flops, "d_bytes": d_bytes, "d_weight_bytes": d["weights"],
        "d_kv_bytes": d["kv"], "decode_steps": d["steps"],
        "experts_touched_per_layer": d["experts_touched_per_layer"],
        "p_s": p_s, "d_s": d_s, "floor_overlap_s": max(p_s, d_s), "floor_serial_s": p_s + d_s,
        "client_wait_floor_s": client_wait_floor(trace, wait_scale),
    }
    out["makespan_lower_bound_s"] = max(out["floor_overlap_s"], out["client_wait_floor_s"])
    if makespan_s is not None:
        out["ratio_overlap"] = makespan_s / out["floor_overlap_s"]
        out["ratio_serial"] = makespan_s / out["floor_serial_s"]
    return out


def measure_peaks(reps: int = 10) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, HBM TB/s) of the current CUDA device, best of `reps` timings."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--measure needs a CUDA device, and torch.cuda.is_available() is False "
                           "here; pass --peak-tflops and --hbm-tbps instead")

    def best_s(fn, iters: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        return min(times)

    n = 8192
    a, b, c = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tflops = 2 * n**3 / best_s(lambda: torch.matmul(a, b, out=c), 10) / 1e12
    a = b = c = None  # free the 384 MiB before the copy test
    src = torch.empty(4 << 30, device="cuda", dtype=torch.uint8)  # 4 GiB, far above any cache
    dst = torch.empty_like(src)
    tbps = 2 * src.numel() / best_s(lambda: dst.copy_(src), 3) / 1e12  # read + write
    return tflops, tbps


def report(r: dict) -> str:
    i, c = r["inputs"], r["counts"]
    rows = [
        ("trace", f"{c['trajectories']} trajectories, {c['requests']} requests"),
        ("new prompt tokens", f"{c['new_prompt_tokens']:,} (of {c['prompt_tokens']:,} prompt)"),
        ("output tokens", f"{c['output_tokens']:,}"),
        ("layout", f"tp={i['tp']} dp={i['dp']} ranks={i['ranks']} dtype_bytes={i['dtype_bytes']}"),
        ("peaks", f"{i['peak_tflops']:.1f} TFLOP/s, {i['hbm_tbps']:.2f} TB/s per rank "
                  f"({i['peaks_source']})"),
        ("decode batch", f"{i['decode_batch']:g} ({r['decode_steps']:,.0f} steps, "
                         f"{r['experts_touched_per_layer']:.1f} experts/layer/step)"),
        ("P FLOPs", f"{r['p_flops']:.4e}"),
        ("D bytes", f"{r['d_bytes']:.4e} (weights {r['d_weight_bytes']:.4e}, "
                    f"KV {r['d_kv_bytes']:.4e})"),
        ("P time", f"{r['p_s']:.3f} s"),
        ("D time", f"{r['d_s']:.3f} s"),
        ("floor, P|D overlap", f"{r['floor_overlap_s']:.3f} s"),
        ("floor, P then D", f"{r['floor_serial_s']:.3f} s"),
        ("client-wait floor", f"{r['client_wait_floor_s']:.3f} s (waits x {i['wait_scale']:g}: "
                              f"the longest trajectory's release + waits)"),
        ("makespan >=", f"{r['makespan_lower_bound_s']:.3f} s (the larger floor)"),
    ]
    if "ratio_overlap" in r:
        rows += [("measured makespan", f"{i['makespan_s']:.3f} s"),
                 ("measured / floor", f"{r['ratio_overlap']:.2f}x (overlap), "
                                      f"{r['ratio_serial']:.2f}x (serial)")]
    return "\n".join(f"{k:<20} {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> dict:
    from vllm_ainfer_pd.models.generate import PRESETS as MODEL_PRESETS
    from vllm_ainfer_pd.rollout.generator import PRESETS as TRACE_PRESETS
    from vllm_ainfer_pd.rollout.generator import generate
    from vllm_ainfer_pd.rollout.trace import load_trace

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--trace-preset", choices=list(TRACE_PRESETS), default="gpu-small")
    g.add_argument("--trace", type=Path, help="a JSONL trace file")
    p.add_argument("--seed", type=int, default=0, help="generator seed (with --trace-preset)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model-preset", choices=list(MODEL_PRESETS), default="gpu")
    m.add_argument("--config", type=Path, help="a Hugging Face config.json of a Qwen3-MoE model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--decode-batch", type=float, default=None,
                   help="global decode batch (default: the number of trajectories)")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak per rank (TFLOP/s)")
    p.add_argument("--hbm-tbps", type=float, help="HBM bandwidth per rank (TB/s)")
    p.add_argument("--measure", action="store_true", help="measure both on this CUDA device")
    p.add_argument("--makespan-s", type=float, default=None, help="measured rollout makespan")
    p.add_argument("--wait-scale", type=float, default=1.0,
                   help="the replay's --wait-scale (client waits x this)")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.measure == (args.peak_tflops is not None or args.hbm_tbps is not None):
        p.error("give either --measure or both --peak-tflops and --hbm-tbps")
    if not args.measure and (args.peak_tflops is None or args.hbm_tbps is None):
        p.error("give both --peak-tflops and --hbm-tbps")
    if min(args.tp, args.dp, args.dtype_bytes) < 1:
        p.error("--tp, --dp and --dtype-bytes must be >= 1")
    if not args.wait_scale >= 0:
        p.error(f"--wait-scale must be >= 0, got {args.wait_scale}")

    trace = load_trace(args.trace) if args.trace else generate(args.trace_preset, args.seed)
    cfg = (json.loads(args.config.read_text()) if args.config
           else MODEL_PRESETS[args.model_preset].hf_config())
    if args.measure:
        try:
            peak, hbm = measure_peaks()
        except RuntimeError as e:
            p.error(str(e))
        source = "measured on this device"
    else:
        peak, hbm, source = args.peak_tflops, args.hbm_tbps, "given"
    batch = len(trace.trajectories) if args.decode_batch is None else args.decode_batch
    if batch <= 0:
        p.error("--decode-batch must be > 0")
    r = floor(trace, MoEShape.from_hf(cfg), args.tp, args.dp, args.dtype_bytes, batch, peak, hbm,
              args.makespan_s, args.wait_scale)
    r["inputs"].update(peaks_source=source, trace=str(args.trace or args.trace_preset),
                       model=str(args.config or args.model_preset), seed=args.seed)
    print(report(r))
    if args.json_out:
        args.json_out.write_text(json.dumps(r, indent=2) + "\n")
    return r


if __name__ == "__main__":
    main()
