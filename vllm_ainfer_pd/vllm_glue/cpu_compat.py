"""What vLLM's CPU path lacks for expert parallelism, supplied at run time in our worker.

Stock vLLM (0.26, and 0.32) cannot serve `--data-parallel-size N --enable-expert-parallel` on the
CPU:
1. `CpuCommunicator.all_gatherv` / `reduce_scatterv` are not implemented (the EP dispatch/combine of
   `AgRsAll2AllManager` calls them with per-rank token counts);
2. the CPU fused-MoE call ignores `expert_map`, so global expert ids index past the local experts
   (0.26: `CPUFusedMOE.__call__`; 0.32: `CPUUnquantizedExperts.apply`).

`install()` adds both to the running process (vLLM's files are not modified). The ainfer_pd
worker calls it on CPU before the model is built, so `mode=normal` and `mode=pd` both get it.
"""

from __future__ import annotations

import torch

from vllm_ainfer_pd.vllm_glue.shapes import Patch, vllm_at_least

_WHY_COMM = ("vLLM 0.26's CPU communicator lacks it, and the EP dispatch/combine of "
             "AgRsAll2AllManager calls it")
PATCHES = [
    Patch("vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator.all_gatherv",
          _WHY_COMM, ("self", "input_", "dim", "sizes"), does="supplies", platform="cpu"),
    Patch("vllm.distributed.device_communicators.cpu_communicator:"
          "CpuCommunicator.reduce_scatterv",
          _WHY_COMM, ("self", "input_", "dim", "sizes"), does="supplies", platform="cpu"),
    Patch("vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE.__call__",
          "vLLM 0.26's CPU fused MoE ignores `expert_map`: under EP global expert ids index past "
          "the local experts",
          ("self", "layer", "x", "use_grouped_topk", "top_k", "router_logits", "renormalize",
           "topk_group", "num_expert_group", "global_num_experts", "expert_map",
           "custom_routing_function", "scoring_func", "routed_scaling_factor",
           "e_score_correction_bias", "apply_router_weight_on_input", "activation"),
          does="wraps", platform="cpu", vllm="<0.32"),
    Patch("vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE", "the wrapped call "
          "runs stock's kernel on the mapped ids", uses=("forward_method",), does="calls",
          platform="cpu", vllm="<0.32"),
    Patch("vllm.model_executor.layers.fused_moe.cpu_fused_moe:select_experts",
          "the wrapped call routes as stock does before it maps expert ids",
          uses=("hidden_states", "router_logits", "use_grouped_topk", "top_k", "renormalize",
                "topk_group", "num_expert_group", "custom_routing_function", "scoring_func",
                "routed_scaling_factor", "e_score_correction_bias"),
          does="calls", platform="cpu", vllm="<0.32"),
    Patch("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.apply",
          "vLLM 0.32's CPU experts pass global expert ids to a kernel that indexes the local "
          "experts with them (a segfault under EP)",
          ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
           "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
           "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input"),
          does="wraps", platform="cpu", vllm=">=0.32"),
    Patch("vllm.model_executor.layers.fused_moe.activation:MoEActivation.SILU",
          "the activation stock's CPU fused MoE defaults to", does="reads", platform="cpu",
          vllm="<0.32"),
]

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    CpuCommunicator.all_gatherv = _all_gatherv
    CpuCommunicator.reduce_scatterv = _reduce_scatterv
    if vllm_at_least("0.32"):
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe

        # The unquantized CPU experts (float32 and bf16; the AMX and Arm variants inherit apply).
        cpu_moe.CPUUnquantizedExperts.apply = _apply_with_local_expert_ids(
            cpu_moe.CPUUnquantizedExperts.apply)
    else:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe

        # CPUFusedMOE is the path for float32 and for bf16 without the AMX "SGL" kernel; the SGL
        # kernel is picked only with VLLM_CPU_SGL_KERNEL=1, which the project does not set.
        cpu_fused_moe.CPUFusedMOE.__call__ = _with_local_expert_ids(
            cpu_fused_moe.CPUFusedMOE.__call__)
    _installed = True


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Concatenate every rank's rows (rank order). `sizes[r]` is rank r's row count; all ranks pass
    the same `sizes`. gloo has no variable-size all-gather, so rows are padded to the largest."""
    if dim != 0:
        raise NotImplementedError(f"all_gatherv supports dim=0 only, got dim={dim}")
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv(self, t, dim, sizes) for t in input_]
    if sizes is None:
        return self.all_gather(input_, dim=0)
    if len(sizes) != self.world_size or input_.shape[0] != sizes[self.rank_in_group]:
        raise ValueError(
            f"all_gatherv: sizes={sizes} do not match world_size={self.world_size} and this "
            f"rank's {input_.shape[0]} rows (rank {self.rank_in_group})"
        )
    most = max(sizes)
    padded = input_.new_zeros((most,) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = input_.new_empty((most * self.world_size,) + tuple(input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, padded, group=self.device_group)
    return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(sizes)])


def _reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    """Sum `input_` over ranks and return this rank's rows (`sizes[rank]` of them, after the rows of
    lower ranks). A full all-reduce, then a slice: correct, and cheap at test sizes."""
    if dim < 0:
        dim += input_.dim()
    rows = input_.movedim(0, dim).contiguous() if dim != 0 else input_.contiguous()
    if sizes is None:
        if rows.shape[0] % self.world_size:
            raise ValueError(f"reduce_scatterv: {rows.shape[0]} rows not divisible by world size")
        sizes = [rows.shape[0] // self.world_size] * self.world_size
    if len(sizes) != self.world_size or rows.shape[0] != sum(sizes):
        raise ValueError(f"reduce_scatterv: sizes={sizes} do not add up to {rows.shape[0]} rows")
    total = rows.clone()
    torch.distributed.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    mine = total[start : start + sizes[self.rank_in_group]]
    return (mine.movedim(0, dim) if dim != 0 else mine).contiguous()


def _with_local_expert_ids(stock_call):
    """Wrap a CPU fused-MoE `__call__` so that, under expert parallelism, it routes as stock does
    and then computes only this rank's experts: global ids are mapped through `expert_map`, and the
    weights of non-local experts are zeroed (their contribution is added by the owning rank in the
    EP combine)."""

    def call(self, layer, x, use_grouped_topk, top_k, router_logits, renormalize, topk_group=None,
             num_expert_group=None, global_num_experts=-1, expert_map=None,
             custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
             e_score_correction_bias=None, apply_router_weight_on_input=False, activation=None):
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts

        activation = MoEActivation.SILU if activation is None else activation
        if expert_map is None:
            return stock_call(self, layer, x, use_grouped_topk, top_k, router_logits, renormalize,
                              topk_group, num_expert_group, global_num_experts, expert_map,
                              custom_routing_function, scoring_func, routed_scaling_factor,
                              e_score_correction_bias, apply_router_weight_on_input, activation)

        topk_weights, topk_ids = select_experts(
            hidden_states=x, router_logits=router_logits, use_grouped_topk=use_grouped_topk,
            top_k=top_k, renormalize=renormalize, topk_group=topk_group,
            num_expert_group=num_expert_group, custom_routing_function=custom_routing_function,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias,
        )
        topk_weights, local_ids = _local_routing(expert_map, topk_weights, topk_ids)
        return self.forward_method(layer, x, topk_weights, local_ids, activation,
                                   global_num_experts, apply_router_weight_on_input)

    call.__wrapped__ = stock_call
    return call


def _apply_with_local_expert_ids(stock_apply):
    """Wrap vLLM 0.32's `CPUUnquantizedExperts.apply` (called with keywords) so that, under expert
    parallelism, its kernel sees local expert ids and zero weight on the slots whose experts live
    on other ranks (their contribution is added by the owning rank in the EP combine)."""

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        if expert_map is not None:
            topk_weights, topk_ids = _local_routing(expert_map, topk_weights, topk_ids)
        return stock_apply(
            self, output=output, hidden_states=hidden_states, w1=w1, w2=w2,
            topk_weights=topk_weights, topk_ids=topk_ids, activation=activation,
            global_num_experts=global_num_experts, expert_map=expert_map, a1q_scale=a1q_scale,
            a2_scale=a2_scale, workspace13=workspace13, workspace2=workspace2,
            expert_tokens_meta=expert_tokens_meta,
            apply_router_weight_on_input=apply_router_weight_on_input)

    apply.__wrapped__ = stock_apply
    return apply


def _local_routing(expert_map: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing for this rank's experts only: zero weight on the slots whose experts live on other
    ranks (the owning rank adds them in the EP combine), and local expert ids."""
    is_local = expert_map[topk_ids.long()] >= 0
    topk_weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
    return topk_weights, _local_expert_ids(expert_map, topk_ids)


def _local_expert_ids(expert_map: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Map global expert ids to local ones. A slot whose expert lives on another rank gets a local
    expert that the row does not use yet (its weight is zeroed by the caller): the CPU kernel counts
    tokens per expert with a scatter, so a row must never name the same expert twice."""
    num_local = int((expert_map >= 0).sum())
    tokens, top_k = topk_ids.shape
    if num_local < top_k:
        raise ValueError(f"CPU expert parallelism needs at least top_k={top_k} experts per rank, "
                         f"this rank has {num_local}")
    mapped = expert_map[topk_ids.long()]
    is_local = mapped >= 0
    used = torch.zeros(tokens, num_local, dtype=torch.bool, device=topk_ids.device)
    rows = torch.arange(tokens, device=topk_ids.device)[:, None].expand(tokens, top_k)
    used[rows[is_local], mapped[is_local]] = True
    free_rank = (~used).long().cumsum(1) - 1  # j-th unused local expert of each row has rank j
    slot_rank = (~is_local).long().cumsum(1) - 1  # j-th remote slot of each row takes rank j
    pick = (~used)[:, None, :] & (free_rank[:, None, :] == slot_rank[:, :, None])
    filler = pick.long().argmax(-1)
    return torch.where(is_local, mapped, filler).to(topk_ids.dtype)
