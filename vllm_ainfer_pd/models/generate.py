"""Deterministic random-weight MoE checkpoints (Qwen3-MoE, and DeepSeek-V3 with MLA attention) and a
byte-level BPE tokenizer, built locally.

Nothing is downloaded: the tokenizer is trained at generation time on `corpus.txt` (shipped in this
package) and padded with filler tokens to exactly the model's vocabulary, so every id the model can
emit decodes. Weights come from `torch.manual_seed(seed)` and the Hugging Face initializer, saved as
safetensors in bf16. The result is a normal Hugging Face folder that `vllm serve` loads.

`ensure_model(preset)` caches the folder under ~/.cache/vllm-ainfer-pd/models/<preset>-<key>, where
the key hashes the preset, the seed, the corpus and the transformers version, so a changed generator
never reuses a stale checkpoint. `ensure_model(preset, eagle=True)` is an EAGLE drafter for that
model (`write_eagle_drafter`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style chat template, so /v1/chat/completions works on the generated model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The tokenizer's <|endoftext|> (id 0) is begin and end of text; checkpoints are bf16.
TOKEN_IDS_AND_DTYPE = {"bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16"}


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a generated MoE model. `weights="dummy"` writes config and tokenizer only: load it
    with vLLM's `load_format="dummy"` (random weights made on the device; GPU preset).
    `family="deepseek_v3"` is DeepSeek-V3's layout: MLA attention (`num_kv_heads` and `head_dim`
    unused), one dense first layer, a shared expert, grouped sigmoid routing. vLLM runs MLA on
    GPUs only."""

    name: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    weights: str = "random"
    family: str = "qwen3_moe"
    # Larger than Hugging Face's 0.02, so random logits are less flat (fewer near-ties in parity).
    initializer_range: float = 0.05

    def __post_init__(self) -> None:
        if self.weights not in ("random", "dummy"):
            raise ValueError(f"weights must be 'random' or 'dummy', got {self.weights!r}")
        if self.family not in ("qwen3_moe", "deepseek_v3"):
            raise ValueError(f"family must be 'qwen3_moe' or 'deepseek_v3', got {self.family!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of {self.num_kv_heads}")

    def hf_config(self) -> dict:
        if self.family == "deepseek_v3":
            return self._deepseek_v3_config()
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.moe_intermediate_size * 2,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            **self._common_config(),
            "decoder_sparse_step": 1,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts_per_tok": self.top_k,
            "num_experts": self.num_experts,
            "norm_topk_prob": True,
            "mlp_only_layers": [],
            **TOKEN_IDS_AND_DTYPE,
        }

    def _common_config(self) -> dict:
        """What both families' configs say alike (in this order, so config.json is unchanged)."""
        return {
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "attention_bias": False,
        }

    def _deepseek_v3_config(self) -> dict:
        # MLA's latent and rope widths are DeepSeek-V3's own: vLLM's Hopper MLA decode kernels
        # (FlashAttention MLA, FlashMLA) take only kv_lora_rank 512 with rope dim 64.
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.moe_intermediate_size * 4,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": 128,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 4,
            "topk_group": 2,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 0,
            **self._common_config(),
            **TOKEN_IDS_AND_DTYPE,
        }


PRESETS: dict[str, ModelPreset] = {
    # CPU tests and `make rollout`: a few MB, loads in seconds.
    "tiny": ModelPreset("tiny", hidden_size=128, num_layers=4, num_experts=16, top_k=4,
                        moe_intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                        vocab_size=512, max_position_embeddings=4096),
    # CPU benchmarks: more layers (more P boundaries) and experts, longer context.
    "bench": ModelPreset("bench", hidden_size=256, num_layers=8, num_experts=32, top_k=4,
                         moe_intermediate_size=128, num_heads=8, num_kv_heads=2, head_dim=32,
                         vocab_size=1024, max_position_embeddings=16384),
    # H200: ~7.5B parameters (64 experts x 24 layers), prefill-saturating; weights made by vLLM.
    "gpu": ModelPreset("gpu", hidden_size=2048, num_layers=24, num_experts=64, top_k=8,
                       moe_intermediate_size=768, num_heads=16, num_kv_heads=4, head_dim=128,
                       vocab_size=32768, max_position_embeddings=32768, weights="dummy"),
    # GPU parity of the lane with MLA attention (DeepSeek-V3's layout); vLLM has no MLA on CPU.
    "tiny-mla": ModelPreset("tiny-mla", hidden_size=256, num_layers=4, num_experts=16, top_k=4,
                            moe_intermediate_size=64, num_heads=16, num_kv_heads=16, head_dim=192,
                            vocab_size=512, max_position_embeddings=4096, family="deepseek_v3"),
    # H200 rollouts on MLA: the `gpu` preset's experts and depth in DeepSeek-V3's layout.
    "gpu-mla": ModelPreset("gpu-mla", hidden_size=2048, num_layers=24, num_experts=64, top_k=8,
                           moe_intermediate_size=768, num_heads=16, num_kv_heads=16, head_dim=192,
                           vocab_size=32768, max_position_embeddings=32768, weights="dummy",
                           family="deepseek_v3"),
}


def cache_root() -> Path:
    return Path(os.environ.get("AINFER_PD_CACHE", Path.home() / ".cache" / "vllm-ainfer-pd"))


def _key(preset: ModelPreset, seed: int, eagle: bool) -> str:
    import transformers

    blob = json.dumps(
        [dataclasses.asdict(preset), seed, CORPUS.read_text(), transformers.__version__,
         CHAT_TEMPLATE] + (["eagle", EAGLE_INTERMEDIATE] if eagle else [])
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_model(preset: str = "tiny", seed: int = 0, eagle: bool = False) -> Path:
    """Return the cached folder of `preset`, or with `eagle` of its EAGLE drafter (generated on
    first use). Safe against concurrent calls: the folder is built under a temporary name and
    renamed into place."""
    spec = get_preset(preset)
    name = f"{spec.name}-eagle" if eagle else spec.name
    path = cache_root() / "models" / f"{name}-s{seed}-{_key(spec, seed, eagle)}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (write_eagle_drafter if eagle else write_model)(spec, tmp, seed)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its folder is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def write_model(preset: ModelPreset, out: Path, seed: int = 0) -> Path:
    """Write tokenizer, config and (for weights='random') bf16 safetensors weights into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(preset.vocab_size, out)
    config = preset.hf_config()
    if preset.weights == "random":
        _write_random_weights(config, out, seed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False})
    )
    (out / "ainfer_pd_preset.json").write_text(
        json.dumps({"preset": dataclasses.asdict(preset), "seed": seed}, indent=2)
    )
    return out


EAGLE_INTERMEDIATE = 256  # the drafter's MLP width


def write_eagle_drafter(preset: ModelPreset, out: Path, seed: int = 0) -> Path:
    """An EAGLE (v1) drafter for `preset`'s model, random bf16 weights, in the layout vLLM's
    `--speculative-config '{"method": "eagle", "model": OUT}'` loads (`EagleLlamaForCausalLM`): `fc`
    joins the token embedding and the target's hidden state, then one Llama decoder layer without
    its input norm; embeddings and LM head are the target's. Random, so it proposes tokens the
    target rejects: it checks that EAGLE runs beside the lane and that outputs stay exact."""
    import torch
    from safetensors.torch import save_file

    if preset.family != "qwen3_moe":
        raise ValueError(f"EAGLE drafters are made for qwen3_moe presets, not {preset.family!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(preset.vocab_size, out)
    h, inter = preset.hidden_size, EAGLE_INTERMEDIATE
    q, kv = preset.num_heads * preset.head_dim, preset.num_kv_heads * preset.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads, "head_dim": preset.head_dim,
        "vocab_size": preset.vocab_size, "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, **TOKEN_IDS_AND_DTYPE,
    }
    gen = torch.Generator().manual_seed(seed + 1)
    layer = "layers.0."
    shapes = {"fc.weight": (h, 2 * h),
              layer + "self_attn.q_proj.weight": (q, h), layer + "self_attn.k_proj.weight": (kv, h),
              layer + "self_attn.v_proj.weight": (kv, h), layer + "self_attn.o_proj.weight": (h, q),
              layer + "mlp.gate_proj.weight": (inter, h), layer + "mlp.up_proj.weight": (inter, h),
              layer + "mlp.down_proj.weight": (h, inter)}
    tensors = {name: (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
               for name, shape in shapes.items()}
    tensors[layer + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_tokenizer(vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE on the shipped corpus, then pad it with filler tokens to
    `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer=trainer)
    filler = [f"<|filler_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_tokens(filler)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)


def _write_random_weights(config: dict, out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if config["model_type"] == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).to(torch.bfloat16)
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(torch.bfloat16)
    tensors = {}
    for name, value in model.state_dict().items():
        tensors.update(_per_expert(name, value.detach()))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _per_expert(name: str, value):
    """Transformers 5 keeps experts fused ([E, 2I, H] gate_up, [E, H, I] down); published Qwen3-MoE
    and DeepSeek-V3 checkpoints, and vLLM's loader, use one gate/up/down Linear per expert. Write
    that layout."""
    prefix, _, leaf = name.rpartition(".experts.")
    if leaf == "gate_up_proj":
        inter = value.shape[1] // 2
        out = {}
        for e in range(value.shape[0]):
            out[f"{prefix}.experts.{e}.gate_proj.weight"] = value[e, :inter].contiguous()
            out[f"{prefix}.experts.{e}.up_proj.weight"] = value[e, inter:].contiguous()
        return out
    if leaf == "down_proj":
        return {f"{prefix}.experts.{e}.down_proj.weight": value[e].contiguous()
                for e in range(value.shape[0])}
    return {name: value.contiguous()}
