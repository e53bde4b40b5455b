"""Settings that let multi-rank vLLM run on a small CPU machine: the rollout comparison's `cpu`
platform applies them to every server it starts, and the tests use the same ones."""

from __future__ import annotations

import os

# Engine arguments for the tiny models on CPU. float32: parity is judged in the layout and precision
# both engines share, and float32 keeps reduction-order noise far below the logit gaps.
CPU_ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "gpu_memory_utilization": 0.1,
    "enforce_eager": True,
    "seed": 0,
}


def cpu_env(num_ranks: int) -> dict[str, str]:
    """Environment for an engine with `num_ranks` worker processes on this machine's cores.

    VLLM_CPU_OMP_THREADS_BIND needs one entry per rank (in DP, PP, TP order); ranks share cores
    round-robin. The KV cache gets 1 GiB: enough for the tiny models, small enough for 4 ranks.
    TorchDynamo is off: with `enforce_eager` the only thing vLLM 0.26 compiles on the CPU is its
    random sampler (`compiled_random_sample`, at start-up in the sampler's warm-up), which took
    12-18 s of every engine process's start on 2 cores and runs the same ops eagerly.
    """
    cores = os.cpu_count() or 1
    if num_ranks == 1:
        bind = f"0-{cores - 1}" if cores > 1 else "0"
    else:
        bind = "|".join(str(rank % cores) for rank in range(num_ranks))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCHDYNAMO_DISABLE": "1",
    }


def apply_cpu_env(num_ranks: int) -> None:
    os.environ.update(cpu_env(num_ranks))


def serve_args(args: dict) -> list[str]:
    """`vllm serve` flags from engine-argument names (`max_model_len` -> `--max-model-len`)."""
    flags: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags
