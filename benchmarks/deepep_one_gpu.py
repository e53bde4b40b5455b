"""Phase-owned DeepEP on one GPU: everything one H200 allows, model-free.

1. `import deep_ep` (the build of scripts/build_deepep.sh), its version, SM90 kernels.
2. Sizes of the phase-owned pair from DeepEP's own helpers (`vllm_ainfer_pd.deepep.buffers.
   DeepEPSizes`), printed as the worker logs them, for EP 2/4/8 and two model shapes, P's SMs 12,
   24 and all: the normal-mode NVLink buffer (P) and the low-latency RDMA buffer (D) per rank.
3. Both buffers of the pair at EP=1, over a one-rank gloo group: DeepEP's constructor accepts one
   rank; its kernels may not. Each step is tried and its outcome recorded exactly:
   - P: `get_dispatch_layout` (rank-generic) against a torch reference; then normal-mode
     `dispatch` (expected to fail: v1.2.1 instantiates its intranode kernels for 2, 4 and 8 ranks
     only, `SWITCH_RANKS`, and has no recommended config for one rank);
   - D: low-latency dispatch and combine (one NVSHMEM PE; needs NVSHMEM's IBGDA transport or
     NVLink P2P to itself) against a torch reference: per local expert, the tokens routed to it;
     combined, each token times the sum of its top-k weights (dyadic weights: exact in bf16);
   - the guard: a normal-mode call on the low-latency buffer raises (`check_normal`).

    python3 benchmarks/deepep_one_gpu.py --out deepep_one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, hidden, experts, top-k): the gpu preset's MoE shape, and the paper's checkpoints.
SHAPES = (("gpu-preset", 2048, 64, 8), ("paper", 2560, 512, 8))


def step(result: dict, name: str, fn) -> object:
    """Run one step; record ok/error (the exception's text, not a crash of the script)."""
    start = time.perf_counter()
    try:
        value = fn()
        result[name] = {"ok": True, "value": value, "s": round(time.perf_counter() - start, 3)}
        print(f"[one-gpu] {name}: ok {value if value is not None else ''}", flush=True)
        return value
    except Exception as exc:  # noqa: BLE001 - which DeepEP step works at one rank is the result
        result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(limit=4)}
        print(f"[one-gpu] {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        return None


def sizes_table(deep_ep, sms_all: int) -> list[dict]:
    from vllm_ainfer_pd.deepep.buffers import DeepEPSizes

    rows = []
    for name, hidden, experts, top_k in SHAPES:
        for ep in (2, 4, 8):
            for sms in (12, 24, sms_all):
                s = DeepEPSizes.compute(deep_ep, ep_size=ep, hidden=hidden, num_experts=experts,
                                        top_k=top_k, p_sms=sms, p_max_tokens=8192,
                                        d_max_tokens=256)
                print(f"[one-gpu] {name} EP={ep}: {s.describe()}", flush=True)
                rows.append({"shape": name, **{k: getattr(s, k) for k in s.__dataclass_fields__}})
    return rows


def routing(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    """Tokens whose first columns name them (exact small integers in bf16), distinct experts per
    token, dyadic top-k weights (sums exact in fp32 and bf16)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(-4, 5, (tokens, hidden), generator=g, device="cuda").to(torch.bfloat16) / 4
    t = torch.arange(tokens, device="cuda")
    x[:, 0], x[:, 1] = (t // 64).to(torch.bfloat16), (t % 64).to(torch.bfloat16)
    topk = torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, dim=1).indices
    weights = 2.0 ** -torch.randint(1, 5, (tokens, top_k), generator=g, device="cuda").float()
    return x, topk.to(torch.int64), weights


def layout_step(buffer, experts: int, top_k: int):
    import torch

    _, topk, _ = routing(96, experts, top_k, 2048, seed=1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    torch.cuda.synchronize()
    ref_expert = torch.bincount(topk.flatten(), minlength=experts).int()
    assert per_rank.tolist() == [96], per_rank.tolist()
    assert torch.equal(per_expert, ref_expert), (per_expert, ref_expert)
    assert bool(in_rank.all()), "every token has an expert on the only rank"
    return {"tokens_per_rank": per_rank.tolist(), "tokens_per_expert_equal_reference": True}


def normal_dispatch_step(deep_ep, buffer, p_sms: int, experts: int, top_k: int):
    x, topk, weights = routing(96, experts, top_k, 2048, seed=2)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
    config = deep_ep.Config(p_sms, 6, 256, 6, 128)  # explicit: v1.2.1 has none for one rank
    recv_x, _, _, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
        topk_weights=weights, config=config)
    combined, _, _ = buffer.combine(recv_x, handle, config=config)
    import torch

    torch.cuda.synchronize()
    assert torch.equal(combined, x), "one rank: combine of dispatch is the input"
    return {"received": int(recv_x.shape[0]), "per_expert": counts}


def low_latency_step(buffer, experts: int, top_k: int, max_tokens: int, hidden: int):
    import torch

    x, topk, weights = routing(max_tokens, experts, top_k, hidden, seed=3)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, max_tokens, experts,
                                                            use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv, topk, weights, handle)
    torch.cuda.synchronize()
    return checked_low_latency(x, topk, weights, recv, count, combined)


def checked_low_latency(x, topk, weights, recv, count, combined) -> dict:
    """Low-latency dispatch and combine against the torch reference: per local expert, the
    tokens routed to it (in any order); combined, each token times its top-k weights' sum."""
    import torch

    def ordered(rows):  # by the token index in columns 0, 1
        return rows[(rows[:, 0].float() * 64 + rows[:, 1].float()).argsort()]

    experts = recv.shape[0]
    for e in range(experts):
        want = x[(topk == e).any(dim=1)]
        got = recv[e, : int(count[e])]
        assert torch.equal(ordered(got), ordered(want)), f"expert {e}"
    reference = (x.float() * weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(combined, reference), (combined - reference).abs().max()
    return {"tokens": int(x.shape[0]), "experts": experts,
            "dispatch_and_combine_equal_reference": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="deepep_one_gpu.json")
    ap.add_argument("--p-sms", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ll-tokens", type=int, default=128)
    args = ap.parse_args()
    result: dict = {"argv": sys.argv[1:]}
    try:
        run(args, result)
    finally:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"[one-gpu] wrote {args.out}", flush=True)
    return 0 if result.get("import", {}).get("ok") else 1


def run(args, result: dict) -> None:
    import torch
    import torch.distributed as dist

    from ainfer_pd_testing.launch import free_port, init_gloo
    from vllm_ainfer_pd.deepep.buffers import DeepEPSizes, PhaseBuffers, check_normal

    deep_ep = step(result, "import", lambda: __import__("deep_ep"))
    if deep_ep is None:
        return
    result["import"]["value"] = deep_ep.__file__
    result["sm90_compiled"] = deep_ep.Buffer.is_sm90_compiled()
    props = torch.cuda.get_device_properties(0)
    result["device"] = {"name": props.name, "sms": props.multi_processor_count,
                        "torch": torch.__version__, "cuda": torch.version.cuda}
    print(f"[one-gpu] {props.name}, {props.multi_processor_count} SMs, DeepEP {deep_ep.__file__}",
          flush=True)
    sms_all = props.multi_processor_count - props.multi_processor_count % 2
    step(result, "sizes", lambda: sizes_table(deep_ep, sms_all))
    step(result, "sizes_ep1", lambda: DeepEPSizes.compute(
        deep_ep, ep_size=1, hidden=args.hidden, num_experts=args.experts, top_k=args.top_k,
        p_sms=args.p_sms, p_max_tokens=8192, d_max_tokens=args.ll_tokens))

    torch.cuda.set_device(0)
    init_gloo(0, 1, free_port())
    group = dist.group.WORLD
    local_experts = args.experts  # one rank holds every expert
    d_rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, args.hidden, 1,
                                                           args.experts)
    d_buffer = step(result, "d_low_latency_buffer_ep1", lambda: deep_ep.Buffer(
        group, num_nvl_bytes=0, num_rdma_bytes=d_rdma, low_latency_mode=True,
        num_qps_per_rank=local_experts, explicitly_destroy=True))
    # EP=1 has no recommended normal-mode config (DeepEPSizes refuses it): size P's NVLink ring
    # with the EP=2 chunk sizes at one rank, DeepEP's own hint.
    p_config = deep_ep.Config(args.p_sms, 6, 256, 6, 128)
    p_nvl = p_config.get_nvl_buffer_size_hint(args.hidden * 2, 1)
    sizes = DeepEPSizes(1, args.hidden, args.experts, args.top_k, args.p_sms, 8192,
                        args.ll_tokens, p_nvl, d_rdma, 0, 8192 * args.hidden * 2)
    print(f"[one-gpu] EP=1 pair: {sizes.describe()}", flush=True)
    result["sizes_pair_ep1"] = sizes.describe()
    buffers = step(result, "p_normal_buffer_ep1",
                   lambda: PhaseBuffers(deep_ep, group, sizes, d_buffer,
                                        configs=(p_config, p_config)))
    if buffers is not None:
        result["p_normal_buffer_ep1"]["value"] = "built"
        step(result, "p_dispatch_layout_ep1",
             lambda: layout_step(buffers.for_p(), args.experts, args.top_k))
        step(result, "p_normal_dispatch_combine_ep1",
             lambda: normal_dispatch_step(deep_ep, buffers.for_p(), args.p_sms, args.experts,
                                          args.top_k))
    if d_buffer is not None:
        result["d_low_latency_buffer_ep1"]["value"] = "built"
        step(result, "d_low_latency_dispatch_combine_ep1",
             lambda: low_latency_step(d_buffer, args.experts, args.top_k, args.ll_tokens,
                                      args.hidden))

        def guard() -> str:
            try:
                check_normal(d_buffer, d_buffer)
            except AssertionError as exc:
                return f"raised: {exc}"
            raise RuntimeError("a normal-mode call on the low-latency buffer was not refused")

        step(result, "guard_normal_call_on_low_latency_buffer", guard)
    for name, buf in (("p", buffers.normal if buffers else None), ("d", d_buffer)):
        if buf is not None:
            step(result, f"destroy_{name}", buf.destroy)


if __name__ == "__main__":
    raise SystemExit(main())
