"""`GlooRendezvous`: the barrier as one small all-gather on a gloo group (any layout), and the
bounded all-gather the hierarchical rendezvous also uses between hosts."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from vllm_ainfer_pd.turnstile.errors import (
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
)
from vllm_ainfer_pd.turnstile.rendezvous.base import (
    MAX_PAYLOAD,
    Payload,
    Rendezvous,
    describe_generation,
    phase_of,
)


def all_gather_or_raise(rdv: Rendezvous, gathered: list, tensor: Any, group: Any, phase: str,
                        rnd: int, missing: Callable[[], tuple[tuple[int, ...], str]]) -> None:
    """All-gather `tensor` into `gathered` over gloo `group` within `rdv.timeout_s`; on failure
    raise RendezvousTimeout (or RendezvousError) naming `rdv.rank`, the phase, the round and what
    `missing()` returns: (missing ranks, detail)."""
    import torch.distributed as dist

    start = time.monotonic()
    try:
        work = dist.all_gather(gathered, tensor, group=group, async_op=True)
        work.wait(timedelta(seconds=rdv.timeout_s))
    except RuntimeError as exc:
        waited = time.monotonic() - start
        timed_out = "timed out" in str(exc).lower() or waited >= 0.99 * rdv.timeout_s
        cls = RendezvousTimeout if timed_out else RendezvousError
        late, detail = missing()
        raise cls(f"rendezvous {'timed out' if timed_out else 'failed'} after {waited:.3g} s",
                  rank=rdv.rank, phase=phase, round=rnd, missing=late,
                  detail=f"{detail}; gloo: {exc}") from exc


class GlooRendezvous(Rendezvous):
    """Barrier as one small CPU all-gather on a gloo process group (works across hosts).

    Each phase all-gathers `[gen, payload length, payload...]`, so the barrier also checks that
    every rank stood in the same phase of the same round (`RendezvousMismatch` otherwise). Before
    the all-gather a rank notes its generation in the group's key-value store (one small `set`);
    that note carries nothing the protocol uses, but lets a rank that times out name the peers
    that never arrived, which the all-gather alone cannot (if the store's host rank has already
    exited, the error says the store is unreachable instead). Ranks are global ranks. After an
    error the group may be left with a pending collective: treat it as fatal for the job.

    `group` defaults to the world group; it must use the gloo backend. `store` defaults to the
    default group's store.
    """

    def __init__(self, group: Any = None, *, store: Any = None, timeout_s: float = 60.0,
                 name: str = "turnstile") -> None:
        import torch
        import torch.distributed as dist

        self._group = group if group is not None else dist.group.WORLD
        self._ranks = dist.get_process_group_ranks(self._group)
        super().__init__(dist.get_rank(), len(self._ranks), timeout_s)
        if store is None:
            # Private accessor, used because torch offers no public handle on the default store.
            store = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"ainfer_pd/rdv/{name}/", store)
        # Per rank: [generation, payload length, payload...]; gathered from every rank.
        width = 2 + MAX_PAYLOAD
        self._buf = torch.zeros(width, dtype=torch.int64)
        self._gathered = [torch.zeros(width, dtype=torch.int64) for _ in self._ranks]

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        self._store.set(str(self.rank), str(gen))
        self._buf.zero_()
        self._buf[0], self._buf[1] = gen, len(payload)
        for i, value in enumerate(payload):
            self._buf[2 + i] = value
        all_gather_or_raise(self, self._gathered, self._buf, self._group, phase, rnd,
                            lambda: self._late_ranks(gen))
        gens = [int(t[0]) for t in self._gathered]
        high, low = max(gens), min(gens)
        if high != gen or low != gen:
            raise RendezvousMismatch(
                "ranks met in different phases", rank=self.rank, phase=phase, round=rnd,
                detail=f"ranks stood between {phase_of(low)} and {phase_of(high)}")
        return [tuple(int(v) for v in t[2 : 2 + int(t[1])]) for t in self._gathered]

    def _late_ranks(self, gen: int) -> tuple[tuple[int, ...], str]:
        late: dict[int, int] = {}
        try:
            for r in self._ranks:
                key = str(r)
                seen = int(self._store.get(key)) if self._store.check([key]) else 0
                if seen < gen:
                    late[r] = seen
        except RuntimeError as exc:  # the store itself may be gone with a crashed rank 0
            return (), f"store unreachable ({exc})"
        return tuple(late), "; ".join(f"rank {r} {describe_generation(g)}" for r, g in late.items())
