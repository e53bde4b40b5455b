"""The phase-owned DeepEP pair on one GPU, with D's buffer built by vLLM 0.26's own manager.

1. What is installed: `deep_ep` (file, version, the commit `scripts/build_deepep.sh` recorded in
   its build_info.json), NVSHMEM, NCCL (the library this process loaded, and torch's), the
   driver and the device.
2. The backend's start-up check (`vllm_ainfer_pd.deepep.buffers.check_api`): the installed
   `deep_ep.Buffer` against what vLLM 0.26's managers and kernels and the lane pass.
3. vLLM's distributed state at world size 1, then vLLM's `DeepEPLLAll2AllManager` over the EP
   group's CPU group builds D's low-latency buffer through `get_handle`, with the arguments
   vLLM's MoE layer gives it (`fused_moe/all2all_utils.py`: tokens per DP rank, hidden size, EP
   ranks, global and local experts). This is the constructor call DeepEP v1.2.1 fails
   (`enable_shrink`).
4. The lane's normal-mode buffer beside it in the same process (`PhaseBuffers`, with explicit
   EP=1 configs: DeepEP recommends none for one rank), the guard (a normal-mode call reaching
   the low-latency buffer raises), the pair's sizes for EP 2/4/8 with vLLM's NVLink bytes for D,
   and P's SM count kept in P's configs after DeepEP's class-wide count is set to another value
   (as vLLM's high-throughput manager's `set_num_sms` does).
5. The low-latency dispatch and combine at EP=1 on vLLM's buffer, with the keywords vLLM's
   low-latency prepare/finalize passes (receive hooks, `out=`), against a torch reference.
6. vLLM's manager destroys its buffer; P's 1-rank normal-mode buffer is destroyed last (v1.2.1
   failed there at one rank).

    python3 benchmarks/deepep_vllm_one_gpu.py \
        --build-info ~/.cache/vllm-ainfer-pd/deepep-build/build_info.json \
        --out deepep_vllm_one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepep_one_gpu import checked_low_latency, routing, step  # the one-GPU script's


def versions(build_info: str | None) -> dict:
    """What ran: DeepEP (and the commit its build recorded), NVSHMEM, NCCL, driver, device."""
    import ctypes
    import importlib.metadata

    import torch

    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "torch_nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    for package in ("vllm", "deep_ep", "nvidia-nvshmem-cu13", "nvidia-nccl-cu13"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    try:  # the NCCL this process loaded (torch's, or one preloaded before it)
        version = ctypes.c_int()
        ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(version))
        v = version.value
        out["nccl_loaded"] = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    except (OSError, AttributeError) as exc:
        out["nccl_loaded"] = f"unknown ({exc})"
    try:
        out["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
            check=False, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["driver"] = f"unknown ({exc})"
    if build_info and os.path.exists(build_info):
        with open(build_info) as f:
            out["deepep_build"] = json.load(f)
    return out


def vllm_low_latency_buffer(max_tokens: int, hidden: int, experts: int,
                            backend: str = "nccl") -> tuple:
    """vLLM's distributed state at world size 1, then D's low-latency buffer as vLLM 0.26's
    `DeepEPLLAll2AllManager` builds it for a MoE layer (`all2all_utils`); returns (manager,
    buffer, the EP group's CPU group)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
    from vllm.distributed.parallel_state import get_ep_group

    from ainfer_pd_testing.launch import free_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend=backend,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(tensor_model_parallel_size=1)
        cpu_group = get_ep_group().cpu_group
        manager = DeepEPLLAll2AllManager(cpu_group)
        ep_ranks = manager.world_size
        buffer = manager.get_handle({"max_num_tokens_per_dp_rank": max_tokens,
                                     "token_hidden_size": hidden, "num_ep_ranks": ep_ranks,
                                     "num_global_experts": experts,
                                     "num_local_experts": experts // ep_ranks})
    return manager, buffer, cpu_group


def vllm_style_low_latency_step(buffer, experts: int, top_k: int, max_tokens: int, hidden: int):
    """Low-latency dispatch and combine with the keywords vLLM's low-latency prepare/finalize
    passes (bf16, receive hooks, the combine into `out`), checked as the one-GPU script checks
    its own (`checked_low_latency`)."""
    import torch

    x, topk, weights = routing(max_tokens, experts, top_k, hidden, seed=4)
    recv, count, handle, _, hook = buffer.low_latency_dispatch(
        x, topk, max_tokens, experts, use_fp8=False, round_scale=False, use_ue8m0=False,
        async_finish=False, return_recv_hook=True)
    hook()
    combined = torch.empty_like(x)
    _, _, hook = buffer.low_latency_combine(recv, topk, weights, handle, async_finish=False,
                                            zero_copy=False, return_recv_hook=True, out=combined)
    hook()
    torch.cuda.synchronize()

    return checked_low_latency(x, topk, weights, recv, count, combined)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="deepep_vllm_one_gpu.json")
    ap.add_argument("--build-info", default=None, help="scripts/build_deepep.sh's build_info.json")
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
    essential = ("check_api", "d_buffer_through_vllm_manager", "p_normal_buffer_beside_it",
                 "d_low_latency_dispatch_combine_vllm_kwargs")
    return 0 if all(result.get(k, {}).get("ok") for k in essential) else 1


def run(args, result: dict) -> None:
    import torch

    from vllm_ainfer_pd.deepep.buffers import DeepEPSizes, PhaseBuffers, check_api, check_normal

    result["versions"] = versions(args.build_info)
    print(f"[one-gpu] {json.dumps(result['versions'])}", flush=True)
    deep_ep = step(result, "import", lambda: __import__("deep_ep"))
    if deep_ep is None:
        return
    result["import"]["value"] = deep_ep.__file__
    result["sm90_compiled"] = deep_ep.Buffer.is_sm90_compiled()
    step(result, "check_api", lambda: check_api(deep_ep))
    torch.cuda.set_device(0)
    props = torch.cuda.get_device_properties(0)
    result["device"] = {"name": props.name, "sms": props.multi_processor_count}

    built = step(result, "d_buffer_through_vllm_manager", lambda: vllm_low_latency_buffer(
        args.ll_tokens, args.hidden, args.experts))
    if built is None:
        return
    manager, d_buffer, group = built
    result["d_buffer_through_vllm_manager"]["value"] = {
        "manager": type(manager).__name__, "low_latency_mode": d_buffer.low_latency_mode,
        "num_rdma_bytes": d_buffer.num_rdma_bytes, "num_nvl_bytes": d_buffer.num_nvl_bytes}

    # P's normal-mode buffer beside D's; EP=1 has no recommended config: explicit ones, with
    # P's SM count, and P's NVLink ring sized from them (DeepEP's own hint).
    config = deep_ep.Config(args.p_sms, 6, 256, 6, 128)
    p_nvl = config.get_nvl_buffer_size_hint(args.hidden * 2, 1)
    sizes = DeepEPSizes(1, args.hidden, args.experts, args.top_k, args.p_sms, 8192,
                        args.ll_tokens, p_nvl, d_buffer.num_rdma_bytes, d_buffer.num_nvl_bytes,
                        8192 * args.hidden * 2)
    result["sizes_pair_ep1"] = sizes.describe()
    print(f"[one-gpu] EP=1 pair: {sizes.describe()}", flush=True)
    buffers = step(result, "p_normal_buffer_beside_it",
                   lambda: PhaseBuffers(deep_ep, group, sizes, d_buffer, configs=(config, config)))
    if buffers is not None:
        result["p_normal_buffer_beside_it"]["value"] = "built"

        def sm_count() -> dict:
            saved = deep_ep.Buffer.num_sms
            deep_ep.Buffer.set_num_sms(8)  # what vLLM's high-throughput manager may do
            try:
                kept = (buffers.dispatch_config.num_sms, buffers.combine_config.num_sms)
            finally:
                deep_ep.Buffer.num_sms = saved
            assert kept == (args.p_sms, args.p_sms), kept
            return {"p_configs_num_sms": kept, "class_wide_set_to": 8}

        step(result, "p_sm_count_own", sm_count)

    def guard() -> str:
        try:
            check_normal(d_buffer, d_buffer)
        except AssertionError as exc:
            return f"raised: {exc}"
        raise RuntimeError("a normal-mode call on the low-latency buffer was not refused")

    step(result, "guard_normal_call_on_low_latency_buffer", guard)
    step(result, "sizes_ep_2_4_8", lambda: [DeepEPSizes.compute(
        deep_ep, ep_size=ep, hidden=args.hidden, num_experts=args.experts, top_k=args.top_k,
        p_sms=args.p_sms, p_max_tokens=8192, d_max_tokens=args.ll_tokens,
        d_nvl_bytes=d_buffer.num_nvl_bytes).describe() for ep in (2, 4, 8)])
    step(result, "d_low_latency_dispatch_combine_vllm_kwargs", lambda: vllm_style_low_latency_step(
        d_buffer, args.experts, args.top_k, args.ll_tokens, args.hidden))
    step(result, "destroy_d_through_vllm_manager", manager.destroy)
    if buffers is not None:
        step(result, "destroy_p", buffers.destroy)


if __name__ == "__main__":
    raise SystemExit(main())
