"""vLLM's collective entry points, routed for the P thread.

P reuses vLLM's communicators (`GroupCoordinator`), whose device state is not safe under use from
two streams at once, so each P collective must be issued where the lane says (on D's stream,
after the D iteration the turnstile released P's segment behind: `PLane.issue_collective`).
`install()` wraps the entry points P's forward can reach, once per process; a thread that called
`route_calling_thread(issue)` has its outermost collective calls (some collectives call others)
go through `issue(group, collective, args, kwargs)`. Every other thread, and a group of one
rank, calls vLLM's method directly after one thread-local lookup.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from vllm_ainfer_pd.vllm_glue.shapes import Patch

# vLLM's collective entry points (GroupCoordinator methods) that P's forward can reach.
COLLECTIVES = {
    "_all_reduce_out_place": ("self", "input_"),
    "all_gather": ("self", "input_", "dim"),
    "all_gatherv": ("self", "input_", "dim", "sizes"),
    "reduce_scatter": ("self", "input_", "dim"),
    "reduce_scatterv": ("self", "input_", "dim", "sizes"),
    "dispatch_router_logits": ("self", "hidden_states", "router_logits", "is_sequence_parallel",
                               "extra_tensors"),
    "dispatch": ("self", "hidden_states", "topk_weights", "topk_ids", "is_sequence_parallel",
                 "extra_tensors"),
    "combine": ("self", "hidden_states", "is_sequence_parallel"),
}
PATCHES = [
    Patch(f"vllm.distributed.parallel_state:GroupCoordinator.{name}", "P's collectives on "
          "vLLM's communicators are issued on D's stream, ordered after the D iteration that "
          "released them", params, does="wraps")
    for name, params in COLLECTIVES.items()
] + [
    Patch("vllm.distributed.parallel_state:GroupCoordinator", "the route registers each group "
          "P uses by name and ranks", uses=("unique_name", "ranks", "world_size"), does="reads"),
    Patch("vllm.forward_context:DPMetadata", "a failed rank's replay sizes its stand-ins for "
          "the MoE dispatch and combine as vLLM's all-gather/reduce-scatter dispatch does",
          uses=("local_sizes", "num_tokens_across_dp_cpu"), does="reads"),
]

Issue = Callable[[Any, Callable[..., Any], tuple, dict], Any]
_ROUTE = threading.local()  # .issue: the calling thread's route; .depth: inside a routed call


def route_calling_thread(issue: Issue | None) -> None:
    """Route the calling thread's collectives through `issue` (None: back to vLLM's own)."""
    _ROUTE.issue = issue
    _ROUTE.depth = 0


def install() -> None:
    """Wrap vLLM's collectives once per process."""
    from vllm.distributed.parallel_state import GroupCoordinator

    if getattr(GroupCoordinator, "_ainfer_pd_routed", False):
        return
    for name in COLLECTIVES:
        collective = getattr(GroupCoordinator, name, None)
        if collective is not None:
            setattr(GroupCoordinator, name, _routed(collective))
    GroupCoordinator._ainfer_pd_routed = True


def _routed(collective: Any) -> Any:
    @functools.wraps(collective)
    def wrapper(group: Any, *args: Any, **kwargs: Any) -> Any:
        issue = getattr(_ROUTE, "issue", None)
        if issue is None or group.world_size == 1 or getattr(_ROUTE, "depth", 0):
            return collective(group, *args, **kwargs)
        _ROUTE.depth = 1
        try:
            return issue(group, collective, args, kwargs)
        finally:
            _ROUTE.depth = 0

    return wrapper


def took_stand_in() -> bool:
    """Whether the calling thread's last routed collective returned a stand-in (and clear it);
    for a test's record of the collectives a rank really issued."""
    took, _ROUTE.stood_in = getattr(_ROUTE, "stood_in", False), False
    return took


def stand_in(group: Any, collective: Any, args: tuple, kwargs: dict) -> Any:
    """What a collective that is not issued returns: a tensor of the shape the real one returns
    (its values mean nothing). Only a failed epoch's no-work replay uses it, for the collectives
    this rank issued before it failed (`PThread`): its peers already paired them, and the replay
    issues the rest."""
    import inspect

    import torch

    _ROUTE.stood_in = True

    name = collective.__name__
    bound = inspect.signature(collective).bind(group, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    world, rank = group.world_size, group.rank_in_group

    def gathered(t: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None:
            return torch.cat([t] * world, dim=dim)
        shape = list(t.shape)
        shape[dim] = sum(sizes)
        return t.new_zeros(shape)

    def scattered(t: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None:
            return t.chunk(world, dim=dim)[rank].clone()
        return t.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone()

    if name == "_all_reduce_out_place":
        return a["input_"].clone()
    if name == "all_gather":
        return gathered(a["input_"], a["dim"], None)
    if name == "all_gatherv":
        inputs = a["input_"]
        if isinstance(inputs, (list, tuple)):
            return [gathered(t, a["dim"], a["sizes"]) for t in inputs]
        return gathered(inputs, a["dim"], a["sizes"])
    if name == "reduce_scatter":
        return scattered(a["input_"], a["dim"], None)
    if name == "reduce_scatterv":
        return scattered(a["input_"], a["dim"], a["sizes"])
    if name in ("dispatch_router_logits", "dispatch", "combine"):
        # vLLM's all-gather/reduce-scatter dispatch takes its sizes from the forward context's
        # DP metadata: one per DP rank, or with sequence-parallel MoE (TP > 1 with DP and EP)
        # one per EP rank, each holding its share of its replica's tokens (`sp_local_sizes`).
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().dp_metadata
        sizes = (meta.local_sizes if meta.local_sizes is not None
                 else meta.num_tokens_across_dp_cpu.tolist())
        member = group.rank_in_group // (world // len(sizes))
        if name == "combine":
            t = a["hidden_states"]
            return t.narrow(0, sum(sizes[:member]), sizes[member]).clone()
        names = (("hidden_states", "router_logits") if name == "dispatch_router_logits"
                 else ("hidden_states", "topk_weights", "topk_ids"))
        out = [gathered(a[n], 0, sizes) for n in names]
        if a["extra_tensors"] is not None:
            out.append([gathered(t, 0, sizes) for t in a["extra_tensors"]])
        return tuple(out)
    raise NotImplementedError(f"no stand-in for the collective {name}")
