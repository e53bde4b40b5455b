"""The embedded model generator: deterministic, self-contained, loadable by Hugging Face."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vllm_ainfer_pd.models import PRESETS, write_model
from vllm_ainfer_pd.models.generate import get_preset


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_gives_identical_files(tmp_path, tiny_model):
    write_model(PRESETS["tiny"], tmp_path / "again", seed=0)
    assert _digest(tmp_path / "again") == _digest(Path(tiny_model))


def test_other_seed_gives_other_weights(tiny_model, tiny_model_other_seed):
    a, b = _digest(Path(tiny_model)), _digest(Path(tiny_model_other_seed))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_tokenizer_covers_exactly_the_model_vocab(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    assert len(tok) == config["vocab_size"] == PRESETS["tiny"].vocab_size
    text = "Prefill reads the whole prompt."
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_weights_use_per_expert_layout(tiny_model):
    from safetensors import safe_open

    with safe_open(str(Path(tiny_model) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        spec = PRESETS["tiny"]
        for e in range(spec.num_experts):
            assert f"model.layers.0.mlp.experts.{e}.gate_proj.weight" in keys
        w = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight")
    assert tuple(w.shape) == (spec.hidden_size, spec.moe_intermediate_size)


def test_gpu_preset_writes_config_only(tmp_path):
    out = write_model(get_preset("gpu"), tmp_path / "gpu")
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["num_experts"] == 64


def test_gpu_mla_preset_is_an_mla_moe_config_without_weights(tmp_path):
    from vllm.config import ModelConfig

    out = write_model(get_preset("gpu-mla"), tmp_path / "gpu-mla")
    assert not (out / "model.safetensors").exists()
    model_config = ModelConfig(model=str(out), skip_tokenizer_init=True, dtype="bfloat16")
    assert model_config.use_mla and model_config.is_moe
    assert model_config.hf_config.n_routed_experts == 64


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")


def test_mla_preset_is_a_deepseek_v3_checkpoint_that_loads_back_unchanged(tmp_path):
    """vLLM runs MLA on GPUs only, so the lane's MLA parity is a GPU job (`gpu_run.sh tp1mla`).
    Here: vLLM reads the folder as an MLA MoE model, and Hugging Face's loader, which maps the
    per-expert checkpoint layout back to its fused experts, gets exactly the generated weights."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    from vllm.config import ModelConfig

    out = write_model(get_preset("tiny-mla"), tmp_path / "mla", seed=0)
    model_config = ModelConfig(model=str(out), skip_tokenizer_init=True, dtype="bfloat16")
    assert model_config.use_mla and model_config.is_moe
    assert model_config.architectures == ["DeepseekV3ForCausalLM"]

    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(0)
    generated = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).to(torch.bfloat16).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert set(loaded) == set(generated)
    assert all(torch.equal(loaded[k], generated[k]) for k in generated)


def test_eagle_drafter_matches_its_target_and_loads_as_vllm_eagle(tmp_path, tiny_model):
    from safetensors.torch import load_file
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    from vllm_ainfer_pd.models.generate import write_eagle_drafter

    out = write_eagle_drafter(get_preset("tiny"), tmp_path / "eagle", seed=0)
    target = json.loads((Path(tiny_model) / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"]
    # vLLM wraps it as EAGLE (v1) on the Llama architecture it names.
    assert EAGLEConfig(model=config, method="eagle").architectures == ["EagleLlamaForCausalLM"]
    weights = load_file(out / "model.safetensors")
    h = target["hidden_size"]
    assert weights["fc.weight"].shape == (h, 2 * h)  # [token embedding, target hidden state]
    assert "layers.0.input_layernorm.weight" not in weights  # EAGLE's first layer has none
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)  # the target's
    assert _digest(write_eagle_drafter(get_preset("tiny"), tmp_path / "again")) == _digest(out)
    with pytest.raises(ValueError, match="qwen3_moe presets, not 'deepseek_v3'"):
        write_eagle_drafter(get_preset("tiny-mla"), tmp_path / "mla")
