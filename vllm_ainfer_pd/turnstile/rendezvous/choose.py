"""Choosing a rendezvous from where the ranks run, and building it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from vllm_ainfer_pd.turnstile.rendezvous.base import NullRendezvous, Rendezvous
from vllm_ainfer_pd.turnstile.rendezvous.gloo import GlooRendezvous
from vllm_ainfer_pd.turnstile.rendezvous.hierarchical import HierarchicalRendezvous
from vllm_ainfer_pd.turnstile.rendezvous.hosts import by_host, host_identity, ranks_text
from vllm_ainfer_pd.turnstile.rendezvous.shm import ShmRendezvous

RENDEZVOUS_KINDS = ("auto", "shm", "gloo")


def choose_rendezvous(kind: str, hosts: Sequence[str]) -> str:
    """What `make_rendezvous(kind, ...)` builds for ranks on `hosts` (one host identity per rank):
    "null", "shm", "hierarchical" or "gloo". Raises ValueError (one line, naming the hosts and
    their ranks) for kind "shm" on ranks of several hosts."""
    if kind not in RENDEZVOUS_KINDS:
        raise ValueError(f"rendezvous kind {kind!r} is not one of {', '.join(RENDEZVOUS_KINDS)}")
    if len(hosts) <= 1:
        return "null"
    if kind == "gloo":
        return "gloo"
    hosts_ranks = by_host(hosts)
    if len(hosts_ranks) == 1:
        return "shm"
    if kind == "shm":
        where = "; ".join(f"host {h!r}: ranks {ranks_text(rs)}" for h, rs in hosts_ranks)
        raise ValueError(f"rendezvous 'shm' needs all ranks on one host, but the {len(hosts)} "
                         f"ranks are on {len(hosts_ranks)} hosts ({where}); use 'auto' (shared "
                         f"memory within each host, gloo between hosts) or 'gloo'")
    if all(len(rs) == 1 for _, rs in hosts_ranks):
        return "gloo"
    return "hierarchical"


def make_rendezvous(kind: str, group: Any = None, *, timeout_s: float = 60.0,
                    host: str | None = None, name: str = "turnstile") -> Rendezvous:
    """The rendezvous of the ranks of torch.distributed `group` (default: the world), by `kind`:

    - "auto": `NullRendezvous` for one rank, `ShmRendezvous` when every rank is on one host,
      `GlooRendezvous` when every host holds one rank, else `HierarchicalRendezvous`;
    - "shm": `ShmRendezvous`; ranks on several hosts raise ValueError at once, on every rank;
    - "gloo": `GlooRendezvous` (one rank: `NullRendezvous`).

    Collective over `group`, a gloo group (vLLM's world group's `cpu_group`); every rank passes
    the same `kind`, `timeout_s` and `name`. Except for "gloo" it all-gathers each rank's host
    identity: `host`, else `host_identity()`, read here once. The hierarchical choice needs
    `group` to span torch's default group (see `HierarchicalRendezvous`). `name` prefixes
    `GlooRendezvous`'s store keys.
    """
    import torch.distributed as dist

    if kind not in RENDEZVOUS_KINDS:
        raise ValueError(f"rendezvous kind {kind!r} is not one of {', '.join(RENDEZVOUS_KINDS)}")
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return NullRendezvous(timeout_s)
    if kind == "gloo":
        return GlooRendezvous(group, timeout_s=timeout_s, name=name)
    seen: list[Any] = [None] * len(ranks)
    me = (host if host is not None else host_identity(), uuid.uuid4().hex[:16])
    dist.all_gather_object(seen, me, group=group)
    hosts = [str(h) for h, _ in seen]
    job = f"ainfer_pd_rdv_{seen[0][1]}"  # group rank 0's pick: one name on every rank
    choice = choose_rendezvous(kind, hosts)
    if choice == "shm":
        return ShmRendezvous(job, ranks.index(dist.get_rank()), len(ranks), timeout_s=timeout_s)
    if choice == "gloo":
        return GlooRendezvous(group, timeout_s=timeout_s, name=name)
    return HierarchicalRendezvous(group, hosts, name=job, timeout_s=timeout_s)
