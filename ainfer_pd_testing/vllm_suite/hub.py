"""Hub model names of vLLM's tests mapped to the embedded tiny model, offline.

`build_hub(folder, model)` writes a Hugging Face hub cache in which each name of `MODELS` is a
snapshot of `model` (links to its files); the run points `HF_HUB_CACHE` at it and sets
`HF_HUB_OFFLINE=1`, so vLLM, transformers and `huggingface_hub` in every process of both runs
resolve those names to the same local folder and download nothing. A name not listed stays
unresolvable: a test that needs it fails in the stock run and does not count.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# The names the chosen modules load (benchmarks/vllm_tests.py, MODULES).
MODELS = (
    "distilbert/distilgpt2",
    "facebook/opt-125m",
    "hmellor/tiny-random-LlamaForCausalLM",
    "hmellor/tiny-random-Gemma2ForCausalLM",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-1B-Instruct",
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2-1.5B-Instruct",
    "openai-community/gpt2",
    "JackFram/llama-160m",
    "JackFram/llama-68m",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "HuggingFaceH4/zephyr-7b-beta",
    "meta-llama/llama-2-7b-hf",
    "google/gemma-3-1b-it",
    "Qwen/Qwen3.5-0.8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct",
    "Qwen/Qwen3-1.7B",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
)


def build_hub(folder: Path, model: Path, names: tuple[str, ...] = MODELS) -> Path:
    """Write (or refresh) the cache under `folder`; returns it. Idempotent."""
    folder = Path(folder)
    files = sorted(p for p in Path(model).iterdir() if p.is_file())
    for name in names:
        repo = folder / ("models--" + name.replace("/", "--"))
        # A fixed commit hash per (name, model), as the hub's snapshots are named.
        commit = hashlib.sha1(f"{name}:{Path(model).resolve()}".encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in files:
            link = snapshot / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return folder


def hub_env(folder: Path) -> dict[str, str]:
    """Environment that makes every process resolve hub names through `folder`, offline."""
    return {
        "HF_HUB_CACHE": str(folder),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
