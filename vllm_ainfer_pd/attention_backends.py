"""Which of vLLM's attention backends the P lane serves, checked at start by name.

P's attention runs through the same layers and kernels as D's, on P's stream and beside D's
step, with metadata that P's own instance of D's metadata-builder class builds from P's batch
(`worker/p_batch.py`). A backend serves the lane when that is all it needs: its builder keeps no
state that D's instance also uses, and its layers read nothing P's batch does not describe.

Checked twice, both times with one line naming the backend (`ConfigError`, which vLLM's config
validation does not fold into a pydantic traceback):
- when the backend is selected (`AInferPDExecutor.validate`, in the frontend and in EngineCore),
  for a backend the user names (`--attention-backend`, `attention_config.backend_per_kind`, a
  speculative drafter's `attention_backend`): before any engine process starts;
- when the worker builds P's batch builder, for the backends vLLM chose for the model's KV cache
  groups (vLLM picks one when none is named).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_ainfer_pd.config import ConfigError

# The backends the lane is built for (vLLM 0.26, CUDA and CPU), each with what is known of it.
# Measured: greedy parity with the lane on against stock vLLM (benchmarks/results/gpu/, CPU tests).
LANE_BACKENDS: dict[str, str] = {
    "CPU_ATTN": "measured: parity on the CPU (make test)",
    "FLASH_ATTN": "measured: parity on 1 and 2 x H200 (vLLM's default on Hopper)",
    "FLASHINFER": "measured: parity on 1 x H200, eager (gpu_run.sh attn1)",
    "TRITON_ATTN": "measured: parity on 1 x H200, eager (gpu_run.sh attn1)",
    "FLEX_ATTENTION": "measured: parity on 1 x H200, eager (gpu_run.sh attn1)",
    "FLASH_ATTN_MLA": "measured: parity on 1 x H200, eager, batch-invariant (gpu_run.sh "
                      "attn1mla; vLLM's first choice for MLA on Hopper)",
    "FLASHINFER_MLA": "not measured: vLLM 0.26 runs it on compute capability 10.x (Blackwell) "
                      "only, not on Hopper",
}

_SPARSE = ("sparse attention reads, in every layer, the top-k token indices an indexer computes "
           "for the same step, which P's batch does not build")
# Backends refused for a known reason; every other name is refused as one the lane is not built
# for.
REFUSED: dict[str, str] = {
    name: _SPARSE for name in (
        "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120",
        "FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4",
        "ROCM_FLASHMLA_SPARSE_DSV4", "ROCM_AITER_MLA_SPARSE", "XPU_MLA_SPARSE",
        "MINIMAX_M3_SPARSE")
}
# MLA backends whose lane tokens are not stock's (1 x H200, bf16,
# benchmarks/results/gpu/attention/). The lane computes each prompt's last token in D's step.
REFUSED["TRITON_MLA"] = (
    "with vLLM's batch-invariant kernels its lane tokens differ from stock's by one bf16 step on "
    "3 of 16 prompts, where stock's own tokens are stable")
REFUSED["FLASHMLA"] = (
    "its lane tokens cannot be held to stock's: vLLM has no batch-invariant FLASHMLA, and with "
    "its default kernels stock's own tokens change with the batch")
NOT_BUILT_FOR = "not among the attention backends the P lane is built for"


def refusal(name: str) -> str | None:
    """The one-line refusal of attention backend `name` (vLLM's name, e.g. `FLASHINFER`), or
    None if the lane serves it."""
    if name in LANE_BACKENDS:
        return None
    mha = [n for n in LANE_BACKENDS if not n.endswith("MLA") and n != "CPU_ATTN"]
    mla = [n for n in LANE_BACKENDS if n.endswith("MLA")]
    return (f"ainfer_pd mode='pd' cannot run the P lane on attention backend {name} "
            f"({REFUSED.get(name, NOT_BUILT_FOR)}); choose one of {', '.join(mha)} "
            f"(MLA models: {', '.join(mla)}) with --attention-backend, or use mode='normal'")


def refuse(names: Iterable[str]) -> None:
    """Raise `ConfigError` for the first of `names` the lane does not serve."""
    for name in names:
        message = refusal(name)
        if message is not None:
            raise ConfigError(message)


def named_backends(vllm_config) -> list[str]:
    """The attention backends the user named in `vllm_config` (none: vLLM chooses)."""
    attention = vllm_config.attention_config
    backends = [attention.backend, *(attention.backend_per_kind or {}).values()]
    speculative = vllm_config.speculative_config
    if speculative is not None:
        backends.append(getattr(speculative, "attention_backend", None))
    return [b.name if hasattr(b, "name") else str(b) for b in backends if b is not None]


def check_config(vllm_config) -> None:
    """At selection: refuse a named backend the lane does not serve."""
    refuse(named_backends(vllm_config))


def check_runner(runner) -> list[str]:
    """In the worker: refuse a backend vLLM chose for one of the runner's attention groups;
    return the backends' names."""
    names = sorted({group.backend.get_name() for groups in runner.attn_groups
                    for group in groups})
    refuse(names)
    return names
