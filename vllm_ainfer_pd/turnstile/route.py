"""Selective stream route: put P collectives that cross D's process groups on D's stream.

Host agreement (the turnstile) gives every rank the same enqueue order; the route turns it into
device order for the conflicting kernels only. At a crossed boundary the registered P collective is
issued on D's graph-launch stream, so stream FIFO runs it after the D iteration enqueued before it;
every other P kernel stays on P's own stream and keeps overlapping D. Paths with no crossing
register nothing and keep their original stream concurrency.

Crossing, precisely. A P group `G_P` crosses a D group `G_D` when

    G_P & G_D != {}   and   not G_P <= G_D

i.e. they share a rank and P's collective also needs ranks outside that D group. P's group is
crossed when it crosses at least one D group of the job. Examples:

- ATP2/ADP2 (paper, Figure 2): P full-TP all-reduce over {0,1,2,3}, D DP all-gather over {0,2} and
  {1,3}: crossed. Rank 0 can hold D's {0,2} kernel waiting for rank 2 while rank 2 holds P's kernel
  waiting for rank 0.
- TP only (DP=1): P and D both over {0,1,2,3}: not crossed. Every P rank is in the one D group,
  whose ranks follow one schedule and communicator order.
- No shared rank: not crossed; the groups cannot wait on each other.

One shared rank suffices: with P groups {0,1},{2,3} and D groups {0,2},{1,3}, the ring
0 -D-> 2 -P-> 3 -D-> 1 -P-> 0 closes although every pair of groups shares just one rank. Hence
`register` takes every D group of the job, not only those containing this rank.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


def crosses(p_group: Iterable[int], d_group: Iterable[int]) -> bool:
    """True when `p_group` and `d_group` share a rank and `p_group` is not inside `d_group`."""
    p, d = frozenset(p_group), frozenset(d_group)
    return bool(p & d) and not p <= d


@dataclass(frozen=True)
class RouteDecision:
    """Where one routed call ran: on D's stream (`crossed`) or P's own stream."""

    seq: int
    name: str
    crossed: bool
    stream: str  # "d" or "p"
    thread: str


@dataclass(frozen=True)
class Registration:
    name: str
    p_group: frozenset[int]
    crossing: tuple[frozenset[int], ...]  # the D groups that P's group crosses


class StreamRoute:
    """Registry of crossed P collectives and the context manager that routes them.

    `d_stream` is D's graph-launch stream (a `torch.cuda.Stream`). With `d_stream=None` (CPU, where
    collectives are synchronous) `route` only records its decision. The registry is written at
    start-up (`register`) and read by the P thread (`route`); decisions are kept in a bounded log
    (`history` entries) plus per-name counters, for tests and metrics.
    """

    def __init__(self, d_stream: Any = None, *, history: int = 4096) -> None:
        self._d_stream = d_stream
        self._crossed: dict[str, Registration] = {}
        self._seq = itertools.count()
        self._log: collections.deque[RouteDecision] = collections.deque(maxlen=history)
        self._counts: collections.Counter[tuple[str, bool]] = collections.Counter()
        self._lock = threading.Lock()

    def register(self, name: str, p_group: Iterable[int],
                 d_groups: Iterable[Iterable[int]], *, shared_communicator: bool = False) -> bool:
        """Register P collective `name` issued over `p_group` against all D groups of the job.

        Stores it and returns True only when it crosses some D group; returns False (and stores
        nothing) otherwise. Re-registering a name with different groups is a ValueError.

        `shared_communicator`: P issues over the very communicator object D uses (in-place
        multiplexing in vLLM), so the two share its device state (NCCL's per-communicator order,
        custom all-reduce's signal flags). Then every D group that shares a rank with P's counts
        as crossed, even one that contains P's group.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"collective name must be a non-empty str, got {name!r}")
        p = _rank_set("p_group", p_group)
        ds = [_rank_set("d_groups entry", g) for g in d_groups]
        crossing = tuple(d for d in ds
                         if crosses(p, d) or (shared_communicator and p & d))
        with self._lock:
            old = self._crossed.get(name)
            if old is not None and (old.p_group, old.crossing) != (p, crossing):
                raise ValueError(f"collective {name!r} already registered with P group "
                                 f"{sorted(old.p_group)}; got {sorted(p)}")
            if crossing:
                self._crossed[name] = Registration(name, p, crossing)
        return bool(crossing)

    def is_crossed(self, name: str) -> bool:
        return name in self._crossed

    @property
    def registrations(self) -> dict[str, Registration]:
        return dict(self._crossed)

    def set_d_stream(self, d_stream: Any) -> None:
        """Install D's graph-launch stream (before the P thread starts routing)."""
        self._d_stream = d_stream

    @contextlib.contextmanager
    def route(self, name: str) -> Iterator[RouteDecision]:
        """Issue the enclosed P collective on the right stream and record the decision.

        Crossed and `d_stream` set: D's stream first waits for P's stream (P -> D edge: the
        collective's inputs are ready), the body runs with D's stream current, and P's stream then
        waits for D's (D -> P edge: later P work sees the result). Tensors made on P's stream and
        freed after the block are safe to reuse, since P's stream is ordered after the collective.
        Otherwise the body runs unchanged on the current stream.
        """
        crossed = name in self._crossed
        on_d = crossed and self._d_stream is not None
        decision = RouteDecision(next(self._seq), name, crossed, "d" if crossed else "p",
                                 threading.current_thread().name)
        with self._lock:
            self._log.append(decision)
            self._counts[(name, crossed)] += 1
        if not on_d:
            yield decision
            return
        import torch

        p_stream = torch.cuda.current_stream()
        d_stream = self._d_stream
        d_stream.wait_stream(p_stream)
        with torch.cuda.stream(d_stream):
            yield decision
        p_stream.wait_stream(d_stream)

    def decisions(self) -> list[RouteDecision]:
        """The most recent decisions, oldest first."""
        with self._lock:
            return list(self._log)

    def count(self, name: str, *, crossed: bool) -> int:
        """How many `route(name)` calls ran with the given decision."""
        with self._lock:
            return self._counts[(name, crossed)]


def _rank_set(what: str, ranks: Iterable[int]) -> frozenset[int]:
    out = frozenset(ranks)
    if not out:
        raise ValueError(f"{what} must name at least one rank, got an empty group")
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ValueError(f"{what} must hold non-negative int ranks, got {sorted(map(repr, bad))}")
    return out
