"""`ShmRendezvous`: the barrier of ranks on one host, in one shared-memory segment."""

from __future__ import annotations

from typing import NoReturn

from vllm_ainfer_pd.turnstile.errors import RendezvousAbandoned, RendezvousTimeout
from vllm_ainfer_pd.turnstile.rendezvous.base import (
    Payload,
    Rendezvous,
    describe_generation,
    phase_of,
)
from vllm_ainfer_pd.turnstile.rendezvous.host_segment import HostSegment


class ShmRendezvous(Rendezvous):
    """Generation-counter barrier in one `HostSegment`, for ranks on one host (tens of
    microseconds per phase).

    A rank arrives by writing its payload, then its generation, into its own slot of the segment,
    and waits until every slot holds at least that generation (the segment's docstring has the
    layout and why no payload word depends on the order of stores). On timeout the slots name the
    missing ranks, and a rank that arrives after a peer timed out fails naming it.

    The creator (rank 0 unless `create` says otherwise) makes the segment named `name` and unlinks
    it on `close`; the others attach, retrying until `timeout_s`. `name` must be unique per job
    (`make_rendezvous` all-gathers one). Ranks here are local indices `0 .. world_size - 1`.
    `spin_s` and `yield_s`: how the wait polls (see `HostSegment`).
    """

    def __init__(self, name: str, rank: int, world_size: int, *, create: bool | None = None,
                 timeout_s: float = 60.0, spin_s: float | None = None,
                 yield_s: float = 5e-4) -> None:
        super().__init__(rank, world_size, timeout_s)
        self.name = name
        self.segment: HostSegment | None = HostSegment(
            name, rank, world_size, create=create, timeout_s=timeout_s, spin_s=spin_s,
            yield_s=yield_s)

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        segment = self.segment
        assert segment is not None, "rendezvous used after close"
        segment.arrive(gen, payload)
        return segment.wait(gen, lambda: segment.gather(gen),
                            lambda waited: self._raise_timeout(segment, gen, phase, rnd),
                            lambda peer, at: self._raise_timeout(segment, gen, phase, rnd,
                                                                 (peer, at)))

    def _raise_timeout(self, segment: HostSegment, gen: int, phase: str, rnd: int,
                       gave_up: tuple[int, int] | None = None) -> NoReturn:
        late = segment.late(gen)
        detail = "; ".join(f"rank {r} {describe_generation(g)}" for r, g in late.items())
        if gave_up is not None:
            peer, at = gave_up
            gone = f"rank {peer} timed out in {phase_of(at)}"
            raise RendezvousAbandoned("a peer gave up waiting", rank=self.rank, phase=phase,
                                      round=rnd, missing=tuple(late),
                                      detail="; ".join(x for x in (gone, detail) if x))
        if not late:
            # Every slot moved on but some payload word never showed this generation's tag:
            # something other than this job's ranks wrote into the segment.
            detail = (f"every rank arrived, but payload words never carried generation {gen} "
                      f"(segment {self.name!r} overwritten?)")
        raise RendezvousTimeout(f"rendezvous timed out after {self.timeout_s:.3g} s",
                                rank=self.rank, phase=phase, round=rnd,
                                missing=tuple(late), detail=detail)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
