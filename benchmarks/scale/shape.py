"""A MoE model's shape and the bytes and FLOPs one forward moves on one rank.

The scale model prices a step by what it reads from memory (weights, decode rows' KV) and what it
computes (every token's linear layers, prefill attention), each divided by an efficiency fitted to
measured steps (`profile.py`). That is what lets one profile carry to other batch shapes, to more
expert-parallel ranks, and to a larger model of the same kind (FLOP and byte scaling).

Assumptions (each only moves time between ranks or steps, none is hidden in a fitted constant):
- Routing is uniform: of E experts with top_k = k, a step of T tokens touches E * (1 - (1 - k/E)^T)
  experts per MoE layer; with expert parallelism over `ep` ranks each rank reads its 1/ep of them
  and computes 1/ep of all ranks' expert work (vLLM's all-gather / reduce-scatter dispatch sends
  every token to every rank; dummy weights route close to uniformly).
- Decode attention reads each row's whole KV once; prefill attention is compute: every new token
  at position p meets p + 1 keys (causal, the cached prefix included).
- The lm_head runs once per row that samples (decode rows and the last chunk of a prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Qwen3-MoE (`attention="gqa"`) or DeepSeek-V3 (`attention="mla"`) layout."""

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    experts: int
    top_k: int
    moe_inter: int
    attention: str = "gqa"
    kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    dense_inter: int = 0
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0
    routing_experts: int = 0  # experts tokens actually spread over (0: all of them)

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.attention == "gqa" and not (self.kv_heads > 0 and self.head_dim > 0):
            raise ValueError("a gqa shape needs kv_heads and head_dim")
        if self.attention == "mla" and not (self.kv_lora_rank > 0 and self.v_head_dim > 0):
            raise ValueError("an mla shape needs kv_lora_rank and v_head_dim")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"need 0 < top_k <= experts, got {self.top_k} of {self.experts}")
        if self.routing_experts and not self.top_k <= self.routing_experts <= self.experts:
            raise ValueError(f"routing_experts={self.routing_experts} must be in [top_k, experts]")
        if not 0 <= self.dense_layers < self.layers:
            raise ValueError(f"dense_layers={self.dense_layers} must be in [0, layers)")

    @classmethod
    def from_hf(cls, name: str, cfg: dict[str, Any], weight_bytes: float = 2.0) -> ModelShape:
        """From a Hugging Face config.json (Qwen3-MoE or DeepSeek-V3 keys)."""
        heads = cfg["num_attention_heads"]
        common = {"name": name, "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                  "heads": heads, "vocab": cfg["vocab_size"], "top_k": cfg["num_experts_per_tok"],
                  "moe_inter": cfg["moe_intermediate_size"], "weight_bytes": weight_bytes}
        if "kv_lora_rank" in cfg:
            return cls(**common, attention="mla", experts=cfg["n_routed_experts"],
                       q_lora_rank=cfg.get("q_lora_rank") or 0,
                       kv_lora_rank=cfg["kv_lora_rank"],
                       qk_nope_head_dim=cfg["qk_nope_head_dim"],
                       qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                       shared_experts=cfg.get("n_shared_experts") or 0,
                       dense_layers=cfg.get("first_k_dense_replace", 0),
                       dense_inter=cfg.get("intermediate_size", 0))
        return cls(**common, attention="gqa", experts=cfg["num_experts"],
                   kv_heads=cfg["num_key_value_heads"],
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelShape:
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- parameter counts --------------------------------------------------------------------

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def attn_params(self) -> int:
        """Attention projections of one layer."""
        h = self.hidden
        if self.attention == "gqa":
            return h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank
             else h * self.heads * qk)
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.heads * self.v_head_dim * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter

    @property
    def dense_params(self) -> int:
        """Every parameter a step reads whatever its batch: attention, routers, shared experts,
        dense MLPs, lm_head (the embedding is a gather of the batch's rows, left out)."""
        moe = self.moe_layers * (self.hidden * self.experts
                                 + self.shared_experts * self.expert_params)
        dense_mlp = self.dense_layers * 3 * self.hidden * self.dense_inter
        return self.layers * self.attn_params + moe + dense_mlp + self.hidden * self.vocab

    @property
    def dense_flops_per_token(self) -> float:
        """Linear-layer FLOPs of one token outside the routed experts and the lm_head."""
        return 2.0 * (self.dense_params - self.hidden * self.vocab)

    @property
    def expert_flops_per_token(self) -> float:
        return 2.0 * self.moe_layers * self.top_k * self.expert_params

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes of one token over all layers."""
        if self.attention == "gqa":
            per_layer = 2 * self.kv_heads * self.head_dim
        else:
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        return per_layer * self.kv_bytes * self.layers

    @property
    def prefill_pair_flops(self) -> float:
        """FLOPs of one (query, key) pair over all layers in a prefill (QK^T and PV)."""
        if self.attention == "gqa":
            per_layer = 4 * self.heads * self.head_dim
        else:
            per_layer = 2 * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim
                                          + self.v_head_dim)
        return float(per_layer * self.layers)

    @property
    def decode_pair_flops(self) -> float:
        """The same for a decode row (MLA decodes in the absorbed latent space)."""
        if self.attention == "gqa":
            return self.prefill_pair_flops
        return float(2 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
                     * self.layers)

    def touched_experts(self, tokens: float) -> float:
        """Experts per MoE layer that a step of `tokens` routed tokens reads: uniform routing over
        `routing_experts` (all experts unless a profile found fewer: a dummy-weight router may
        send every token to the same few)."""
        if tokens <= 0:
            return 0.0
        e = self.routing_experts or self.experts
        return e * (1.0 - (1.0 - self.top_k / e) ** tokens)


@dataclass(frozen=True)
class Batch:
    """One rank's share of a forward: decode rows and prefill chunks.

    `rows`: decode rows (each samples one token); `context`: the sum of their context lengths;
    `chunks`: (new tokens, tokens already computed before them) per prefill chunk; `samples`:
    chunks that finish their prompt (and so sample)."""

    rows: int = 0
    context: int = 0
    chunks: tuple[tuple[int, int], ...] = ()
    samples: int = 0

    @property
    def tokens(self) -> int:
        return self.rows + sum(n for n, _ in self.chunks)

    @property
    def empty(self) -> bool:
        return self.tokens == 0


def prefill_pairs(chunks: Sequence[tuple[int, int]]) -> float:
    """(query, key) pairs of causal prefill chunks: new token at position p meets p + 1 keys."""
    return float(sum(n * (2 * start + n + 1) // 2 for n, start in chunks))


@dataclass(frozen=True)
class Work:
    """What one rank's forward reads and computes: `flops` in its linear layers and decode
    attention, `attn_flops` in prefill attention (kept apart for the record; the profiles price
    both at one rate)."""

    bytes: float
    flops: float
    attn_flops: float = 0.0


def batch_work(shape: ModelShape, batch: Batch, group_tokens: float, ep: int = 1,
               tp: int = 1) -> Work:
    """Bytes and FLOPs of `batch` on one rank, whose expert-parallel group of `ep` ranks routes
    `group_tokens` tokens in this forward (its own included); `tp` splits everything evenly."""
    tokens = batch.tokens
    expert_bytes = shape.moe_layers * shape.touched_experts(group_tokens) / ep * shape.expert_params
    weights = shape.weight_bytes * (shape.dense_params + expert_bytes)
    kv = shape.kv_bytes_per_token * batch.context
    flops = (shape.dense_flops_per_token * tokens
             + shape.expert_flops_per_token * group_tokens / ep
             + 2.0 * shape.hidden * shape.vocab * (batch.rows + batch.samples)
             + shape.decode_pair_flops * batch.context)
    attn = shape.prefill_pair_flops * prefill_pairs(batch.chunks)
    if tokens == 0 and group_tokens == 0:
        return Work(0.0, 0.0)
    return Work((weights + kv) / tp, flops / tp, attn / tp)
