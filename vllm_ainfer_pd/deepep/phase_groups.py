"""P's own expert-parallel communicators for vLLM's stateless all-to-all
(`allgather_reducescatter`).

vLLM's all-gather / reduce-scatter backend keeps no state between calls, but the communicators it
runs on do: NCCL orders the collectives of one communicator by issue, a gloo group pairs the n-th
call of every rank, and custom all-reduce keeps signal flags. If P's dispatch ran on D's EP/DP
communicators beside D's, the two phases would share that order; so every such P collective had
to be routed onto D's stream behind the D iteration (docs/worker.md, "Stream route").

`PhaseGroups` builds, once per process at worker start and right after vLLM's own groups, a second
`GroupCoordinator` for each of vLLM's EP and DP groups, over the same ranks, with its own device
communicator and all-to-all manager. `vllm_glue.moe_phase` makes the P thread's calls of
`get_ep_group()` / `get_dp_group()` resolve to them, so P's MoE dispatch and combine never touch
D's communicators. The TP group stays shared (P's TP all-reduce is still routed).

After a failed P epoch that used them, P's communicators are rebuilt on every rank at one agreed
point (`rebuild`; `manager.PhaseEP` decides when), never used half-advanced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm_ainfer_pd.turnstile.route import crosses

logger = logging.getLogger(__name__)

# vLLM's groups whose collectives D issues in a forward; each name is also the prefix of the
# group's `unique_name` ("ep:0"). P owns copies of the first two.
P_OWNED = ("ep", "dp")
D_GROUP_GETTERS = ("get_tp_group", "get_dp_group", "get_ep_group", "get_pcp_group",
                   "get_dcp_group", "get_pp_group")


class PhaseGroups:
    """P's copies of vLLM's EP and DP `GroupCoordinator`s, and what P's collectives on them cross.

    Build with `PhaseGroups.build()` on every rank of the job in the same order (it creates process
    groups over the whole world), after `vllm.distributed.initialize_model_parallel`.
    """

    def __init__(self, groups: dict[str, Any], d_groups: list[frozenset[int]]) -> None:
        self.groups = groups  # "ep"/"dp" -> P's GroupCoordinator
        self.d_groups = d_groups  # every D group of the job with at least two ranks
        self._crossed: dict[str, bool] = {}

    @classmethod
    def build(cls) -> PhaseGroups:
        """Collective over the world: every rank calls it at the same point of its start-up."""
        from vllm.distributed import parallel_state

        d_groups: set[frozenset[int]] = set()
        for getter in D_GROUP_GETTERS:
            try:
                group = getattr(parallel_state, getter)()
            except AssertionError:  # a group vLLM did not build (no EP group for dense models)
                continue
            # A group of one rank issues no collective, so it crosses nothing.
            d_groups.update(frozenset(r) for r in group.group_ranks if len(r) > 1)
        return cls(_copy_groups(), sorted(d_groups, key=sorted))

    def get(self, kind: str) -> Any:
        return self.groups.get(kind)

    def owns(self, group: Any) -> bool:
        return any(group is g for g in self.groups.values())

    def crossed(self, group: Any) -> bool:
        """Whether P's collective on its own `group` still needs D's stream: it crosses a D group
        (shares a rank with it and needs ranks outside it, `turnstile.route.crosses`), so separate
        communicators alone do not order it against D's kernels (ATP x ADP layouts). At TP=1 P's
        EP and DP groups equal D's and cross nothing."""
        name = group.unique_name
        if name not in self._crossed:
            self._crossed[name] = any(crosses(group.ranks, d) for d in self.d_groups)
        return self._crossed[name]

    def rebuild(self) -> None:
        """Destroy P's communicators and build new ones over the same ranks. Collective over the
        world: every rank calls it at the same point (the lane agrees on it in a rendezvous),
        once P's submitted device work finished (a GPU communicator must not be destroyed under
        a running kernel)."""
        for group in self.groups.values():
            group.destroy()
        self.groups = _copy_groups()
        self._crossed.clear()

    def destroy(self) -> None:
        for group in self.groups.values():
            group.destroy()
        self.groups = {}

    def describe(self) -> str:
        return ", ".join(f"{kind} {g.unique_name} ranks {g.ranks}" for kind, g in
                         self.groups.items())


def _copy_groups() -> dict[str, Any]:
    """A new `GroupCoordinator` for each of vLLM's EP and DP groups: the same partition of the
    world (`group_ranks`), backend and local rank, so the same device; its `unique_name` is the
    next of its kind ("ep:1"), which vLLM's device communicator reads to give an "ep" group its
    all-to-all manager."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state

    from vllm_ainfer_pd.vllm_glue.moe_phase import copy_group_kwargs

    if get_current_vllm_config_or_none() is None:
        raise RuntimeError("PhaseGroups.build needs vLLM's current config "
                           "(set_current_vllm_config): vLLM's device communicator reads it to "
                           "build an all-to-all manager")
    copies = {}
    for kind in P_OWNED:
        group = getattr(parallel_state, f"get_{kind}_group")()
        copies[kind] = parallel_state.init_model_parallel_group(
            group_ranks=_as_lists(group.group_ranks), local_rank=group.local_rank,
            backend=group.torch_distributed_backend, group_name=kind,
            **copy_group_kwargs(group))
    return copies


def _as_lists(group_ranks: Iterable[Iterable[int]]) -> list[list[int]]:
    return [list(r) for r in group_ranks]
