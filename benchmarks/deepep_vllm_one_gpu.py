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
   and P's SM count in P's configs (the EP=1 ones `PhaseBuffers` holds, and `p_configs` for EP
   2/4/8) with DeepEP's class-wide count set to another value first (as vLLM's high-throughput
   manager's `set_num_sms` does), read through the configs' NVLink size hints (DeepEP's `Config`
   exposes no `num_sms`); P's prepare/finalize passes those configs.
5. The low-latency dispatch and combine at EP=1 on vLLM's buffer, with the keywords vLLM's
   low-latency prepare/finalize passes (receive hooks, `out=`), against a torch reference.
6. vLLM's manager destroys its buffer; P's 1-rank normal-mode buffer is destroyed last. DeepEP's
   `destroy` of a buffer with NVLink bytes runs an NVLink barrier instantiated for 2, 4 and 8
   ranks only (`one_rank_barrier`): that assertion, checked against the built source, is recorded
   as not possible at one rank (ok null); anything else as it is.

    python3 benchmarks/deepep_vllm_one_gpu.py \
        --build-info ~/.cache/vllm-ainfer-pd/deepep-build/build_info.json \
        --out deepep_vllm_one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


OTHER_SMS = 8  # the class-wide count set before P's configs are made (vLLM's set_num_sms may)


def nvl_hints(configs, hidden_bytes: int, ranks: int) -> list[int]:
    return [c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs]


def p_sm_count(deep_ep, buffers, args) -> dict:
    """P's SM count in P's configs, with DeepEP's class-wide `Buffer.num_sms` set to another
    value first. DeepEP's pybind `Config` binds its constructor and the two size hints only
    (csrc/deep_ep.cpp), no `num_sms`, so the count is read through what it sizes: the NVLink
    hint grows with the channels, num_sms / 2 (csrc/config.hpp), and differs between P's count
    and the other. Checked: (a) the EP=1 configs `PhaseBuffers` holds against a `Config` built
    with P's count; (b) `p_configs` (the configs the lane makes for EP 2/4/8) against DeepEP's
    recommended configs at P's count, and the class-wide count is back afterwards."""
    from vllm_ainfer_pd.deepep.buffers import p_configs

    assert args.p_sms != OTHER_SMS
    hidden_bytes = args.hidden * 2
    cls = deep_ep.Buffer
    saved = cls.num_sms
    cls.set_num_sms(OTHER_SMS)
    try:
        held = (buffers.dispatch_config, buffers.combine_config)
        want = nvl_hints([deep_ep.Config(args.p_sms, 6, 256, 6, 128)], hidden_bytes, 1) * 2
        wrong = nvl_hints([deep_ep.Config(OTHER_SMS, 6, 256, 6, 128)], hidden_bytes, 1) * 2
        got = nvl_hints(held, hidden_bytes, 1)
        assert want != wrong, (want, wrong)
        assert got == want, f"EP=1: P's configs size {got}, P's {args.p_sms} SMs size {want}"
        rows = [{"ep": 1, "p_configs_nvl_hint": got, f"at_{args.p_sms}_sms": want,
                 f"at_{OTHER_SMS}_sms": wrong}]
        for ep in (2, 4, 8):
            made = p_configs(deep_ep, ep, args.p_sms)
            assert cls.num_sms == OTHER_SMS, f"p_configs left Buffer.num_sms at {cls.num_sms}"
            reference = {}
            for n in (args.p_sms, OTHER_SMS):
                cls.num_sms = n
                reference[n] = nvl_hints((cls.get_dispatch_config(ep), cls.get_combine_config(ep)),
                                         hidden_bytes, ep)
            cls.num_sms = OTHER_SMS
            got = nvl_hints(made, hidden_bytes, ep)
            want, wrong = reference[args.p_sms], reference[OTHER_SMS]
            assert all(a != b for a, b in zip(want, wrong)), (ep, want, wrong)
            assert got == want, f"EP={ep}: p_configs size {got}, P's {args.p_sms} SMs size {want}"
            rows.append({"ep": ep, "p_configs_nvl_hint": got, f"at_{args.p_sms}_sms": want,
                         f"at_{OTHER_SMS}_sms": wrong})
    finally:
        cls.num_sms = saved
    return {"p_sms": args.p_sms, "class_wide_set_to": OTHER_SMS,
            "read_through": "Config.get_nvl_buffer_size_hint (dispatch, combine)", "rows": rows}


def p_kernels_pass_p_configs(buffers) -> str:
    """The configs P's prepare/finalize passes to DeepEP's dispatch and combine are the ones
    `PhaseBuffers` holds (vLLM's own read `Buffer.num_sms` at each call)."""
    import types

    from vllm_ainfer_pd.deepep.kernels import p_prepare_finalize_cls

    pf = p_prepare_finalize_cls()
    holder = types.SimpleNamespace(buffers=buffers)
    assert pf._get_dispatch_config(holder) is buffers.dispatch_config
    assert pf._get_combine_config(holder) is buffers.combine_config
    return f"{pf.__name__} passes PhaseBuffers' dispatch and combine configs"


ASSERTION = re.compile(r"Assertion error (\S+?):(\d+) 'false and \"Unsupported ranks\"'")


def one_rank_barrier(error: str, buffer, group) -> str | None:
    """Why `destroy` cannot run at one rank, or None where the error is anything else.

    DeepEP's `Buffer::destroy` (csrc/deep_ep.cpp) meets its NVLink peers in
    `intranode::barrier` when the buffer has NVLink bytes; that launch (csrc/kernels/runtime.cu)
    switches over `SWITCH_RANKS` (csrc/kernels/launch.cuh), which has cases for 2, 4 and 8 ranks
    and asserts "Unsupported ranks" for any other count. Returned only when all of it holds here:
    one rank, NVLink bytes in the buffer, the assertion at a line of the built source that is
    `SWITCH_RANKS` inside `intranode`'s `barrier`, and that source's `SWITCH_RANKS` has no case 1.
    """
    match = ASSERTION.search(error)
    if match is None or group.size() != 1 or buffer is None or buffer.num_nvl_bytes <= 0:
        return None
    path, line = match.group(1), int(match.group(2))
    launch = os.path.join(os.path.dirname(path), "launch.cuh")
    if not (os.path.exists(path) and os.path.exists(launch)):
        return None
    with open(path) as f:
        lines = f.read().splitlines()
    if not (0 < line <= len(lines)) or "SWITCH_RANKS(" not in lines[line - 1]:
        return None
    above = lines[:line]
    function = next((x for x in reversed(above) if re.match(r"^\w.*\b(\w+)\(", x)), "")
    namespace = next((x for x in reversed(above) if x.startswith("namespace ")), "")
    if not (re.match(r"^void barrier\(", function) and namespace.startswith("namespace intranode")):
        return None
    with open(launch) as f:
        text = f.read()
    macro = re.search(r"#define SWITCH_RANKS\(case_macro\)((?:.*\\\n)*.*)", text)
    if macro is None:
        return None
    cases = [int(c) for c in re.findall(r"case (\d+):", macro.group(1))]
    if not cases or 1 in cases:
        return None
    return (f"DeepEP's Buffer::destroy meets its NVLink peers ({buffer.num_nvl_bytes} NVLink bytes "
            f"here) in intranode::barrier, {path}:{line}: SWITCH_RANKS, whose cases in "
            f"{launch} are {cases} ranks, asserts 'Unsupported ranks' at 1 rank")


def destroy_step(result: dict, name: str, fn, buffer, group) -> None:
    """`step`, except that DeepEP's one-rank barrier assertion (`one_rank_barrier`, checked
    against the built source) is recorded as not possible at one rank (ok null, with the
    reason); every other outcome stays as `step` records it."""
    step(result, name, fn)
    record = result[name]
    if record["ok"]:
        return
    reason = one_rank_barrier(record["error"], buffer, group)
    if reason is not None:
        result[name] = {"ok": None, "not_possible_at_one_rank": reason, "error": record["error"]}
        print(f"[one-gpu] {name}: not possible at one rank: {reason}", flush=True)


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
                 "p_sm_count_own", "d_low_latency_dispatch_combine_vllm_kwargs")
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

        step(result, "p_sm_count_own", lambda: p_sm_count(deep_ep, buffers, args))
        step(result, "p_kernels_pass_p_configs", lambda: p_kernels_pass_p_configs(buffers))

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
    destroy_step(result, "destroy_d_through_vllm_manager", manager.destroy, d_buffer, group)
    if buffers is not None:
        destroy_step(result, "destroy_p", buffers.destroy, buffers.normal, group)


if __name__ == "__main__":
    raise SystemExit(main())
