"""`HierarchicalRendezvous`: the barrier of ranks on several hosts, shared memory within each host
and one gloo all-gather among the hosts' leaders."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from vllm_ainfer_pd.turnstile.errors import (
    RendezvousAbandoned,
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
from vllm_ainfer_pd.turnstile.rendezvous.gloo import all_gather_or_raise
from vllm_ainfer_pd.turnstile.rendezvous.host_segment import HostSegment
from vllm_ainfer_pd.turnstile.rendezvous.hosts import by_host, ranks_text

_ROW = 1 + MAX_PAYLOAD  # one rank's payload in a leader's row: its length, then the values


class HierarchicalRendezvous(Rendezvous):
    """Barrier for ranks on several hosts: shared memory among the ranks of each host, and one
    gloo all-gather among the hosts' leaders.

    Per phase, every rank arrives in its host's `HostSegment`. The host's leader (its
    lowest rank) waits for the host's ranks, all-gathers their payloads with the other leaders over
    a gloo group of the leaders, and publishes every rank's payload on the segment's board, where
    the host's other ranks read them (with the same self-validating words, see `HostSegment`).
    No rank returns before every rank arrived, and `payloads[r]` is group rank `r`'s. A phase
    costs one all-gather over the hosts rather than the ranks, plus one key-value store `set` per
    leader.

    A timeout names who is missing: ranks of this host from the segment's slots; ranks of another
    host from notes its leader keeps in the job's key-value store (the phase the host last
    completed, and, once the leader has waited `min(1 s, timeout_s / 10)`, the ranks it waits
    for); a host whose leader left no such note is named whole (host, ranks, leader rank).

    Collective over every rank of torch.distributed's default group, which `group` (default: the
    world) must span: torch makes every rank of the default group call `new_group`, members of the
    leaders' group or not. `hosts[r]` is group rank `r`'s host identity and `name` a job-unique
    segment and store prefix; both must be equal on every rank (`make_rendezvous` all-gathers
    them). `store` defaults to the default group's store. Ranks are group ranks. After an error
    the leaders' group may hold a pending collective: treat it as fatal for the job.
    """

    def __init__(self, group: Any, hosts: Sequence[str], *, name: str, timeout_s: float = 60.0,
                 store: Any = None, spin_s: float | None = None) -> None:
        import torch
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        if len(hosts) != len(ranks):
            raise ValueError(f"hosts names {len(hosts)} ranks; the group has {len(ranks)}")
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"HierarchicalRendezvous needs a group of every rank of the default "
                             f"group ({dist.get_world_size()}), got {len(ranks)} ranks")
        super().__init__(ranks.index(dist.get_rank()), len(ranks), timeout_s)
        self._torch = torch
        self._hosts = by_host(hosts)
        self._host = next(h for h, (_, rs) in enumerate(self._hosts) if self.rank in rs)
        self._local = self._hosts[self._host][1]
        self.leader = self._local[0]
        self._group = dist.new_group([ranks[rs[0]] for _, rs in self._hosts], backend="gloo",
                                     timeout=timedelta(seconds=timeout_s))
        if store is None:
            # Private accessor, used because torch offers no public handle on the default store.
            store = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"ainfer_pd/rdv/{name}/", store)
        self._note_after = min(1.0, timeout_s / 10)
        self._next_note, self._noted = 0.0, ""
        # Per leader: [generation, host index, then per rank of the host: length, values].
        self._width = 2 + max(len(rs) for _, rs in self._hosts) * _ROW
        self._gathered = [torch.zeros(self._width, dtype=torch.int64) for _ in self._hosts]
        self._segment: HostSegment | None = None
        if len(self._local) > 1:
            try:
                self._segment = HostSegment(f"{name}_h{self._host}",
                                            self._local.index(self.rank), len(self._local),
                                            timeout_s=timeout_s, spin_s=spin_s,
                                            board=self.world_size)
            except RendezvousTimeout as exc:
                raise RendezvousTimeout("host's shared-memory segment never appeared",
                                        rank=self.rank, phase="attach", round=0,
                                        missing=(self.leader,),
                                        detail=f"leader rank {self.leader} did not create it "
                                        f"within {timeout_s:.3g} s") from exc

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        segment = self._segment
        if segment is None:  # a host of one rank: its leader alone
            return self._exchange(gen, phase, rnd, [payload])

        def timed_out(waited: float) -> NoReturn:
            self._raise_timeout(gen, phase, rnd)

        def peer_gave_up(peer: int, at: int) -> NoReturn:
            missing, detail = self._missing(gen)
            gone = f"rank {self._local[peer]} timed out in {phase_of(at)}"
            raise RendezvousAbandoned("a peer gave up waiting", rank=self.rank, phase=phase,
                                      round=rnd, missing=missing,
                                      detail="; ".join(x for x in (gone, detail) if x))

        segment.arrive(gen, payload)
        if self.rank != self.leader:
            return segment.wait(gen, lambda: segment.read_board(gen), timed_out, peer_gave_up)
        since = time.monotonic()
        local = segment.wait(gen, lambda: self._gather_host(segment, gen, since), timed_out,
                             peer_gave_up)
        try:
            payloads = self._exchange(gen, phase, rnd, local)
        except RendezvousError:
            segment.give_up(gen)  # this host's ranks waiting on the board fail now, naming it
            raise
        segment.post_board(gen, payloads)
        return payloads

    def _gather_host(self, segment: HostSegment, gen: int, since: float) -> list[Payload] | None:
        got = segment.gather(gen)
        if got is None:
            now = time.monotonic()
            if now >= since + self._note_after and now >= self._next_note:
                self._next_note = now + 0.25
                self._note_waiting(gen)
        return got

    def _note_waiting(self, gen: int) -> None:
        """Leave in the store which of this host's ranks the leader waits for at `gen`, so that
        other hosts' ranks that time out can name them."""
        assert self._segment is not None
        late = self._segment.late(gen)
        note = f"{gen};" + ",".join(f"{self._local[i]}:{g}" for i, g in late.items())
        if not late or note == self._noted:
            return
        try:
            self._store.set(f"waiting/{self._host}", note)
        except RuntimeError:
            return  # only a diagnostic: a store gone with its rank must not hide the real wait
        self._noted = note

    def _exchange(self, gen: int, phase: str, rnd: int, local: list[Payload]) -> list[Payload]:
        """All-gather this host's payloads with the other leaders; every rank's, in rank order."""
        torch = self._torch
        row = [gen, self._host]
        for payload in local:
            row += [len(payload), *payload, *[0] * (MAX_PAYLOAD - len(payload))]
        row += [0] * (self._width - len(row))
        # The host's complete arrival, read only by leaders and ranks that time out.
        self._store.set(f"arrived/{self._host}", str(gen))
        all_gather_or_raise(self, self._gathered, torch.tensor(row, dtype=torch.int64),
                             self._group, phase, rnd, lambda: self._missing(gen))
        rows = [t.tolist() for t in self._gathered]
        gens = [r[0] for r in rows]
        if min(gens) != gen or max(gens) != gen:
            raise RendezvousMismatch(
                "hosts met in different phases", rank=self.rank, phase=phase, round=rnd,
                detail=f"hosts stood between {phase_of(min(gens))} and {phase_of(max(gens))}")
        payloads: list[Payload] = [() for _ in range(self.world_size)]
        for r in rows:
            for i, rank in enumerate(self._hosts[r[1]][1]):
                base = 2 + i * _ROW
                payloads[rank] = tuple(r[base + 1 : base + 1 + r[base]])
        return payloads

    def _raise_timeout(self, gen: int, phase: str, rnd: int) -> NoReturn:
        if self._segment is not None and self.rank == self.leader:
            self._next_note = 0.0
            self._note_waiting(gen)  # the latest word on this host for peers still waiting
        missing, detail = self._missing(gen)
        raise RendezvousTimeout(f"rendezvous timed out after {self.timeout_s:.3g} s",
                                rank=self.rank, phase=phase, round=rnd, missing=missing,
                                detail=detail)

    def _missing(self, gen: int) -> tuple[tuple[int, ...], str]:
        """The ranks (or hosts) that keep this rank waiting at `gen`, and where each stood."""
        if self._segment is not None:
            late = self._segment.late(gen)
            if late:
                ranks = [self._local[i] for i in late]
                return tuple(ranks), "; ".join(f"rank {r} {describe_generation(g)}"
                                               for r, g in zip(ranks, late.values(), strict=True))
        missing: list[int] = []
        notes: list[str] = []
        try:
            for h, (host, ranks) in enumerate(self._hosts):
                if h == self._host:
                    continue
                arrived = int(self._note(f"arrived/{h}") or 0)
                if arrived >= gen:
                    continue
                waiting = self._waiting_for(self._note(f"waiting/{h}"), gen)
                for r, g in waiting:
                    missing.append(r)
                    notes.append(f"rank {r} (host {host!r}) {describe_generation(g)}")
                if not waiting:
                    missing.append(ranks[0])
                    notes.append(f"host {host!r} (ranks {ranks_text(ranks)}, leader rank "
                                 f"{ranks[0]}) {describe_generation(arrived)}")
        except RuntimeError as exc:  # the store itself may be gone with a crashed rank 0
            return tuple(missing), "; ".join([*notes, f"store unreachable ({exc})"])
        if missing:
            return tuple(missing), "; ".join(notes)
        if self.rank != self.leader:
            return (self.leader,), (f"every host arrived, but leader rank {self.leader} never "
                                    f"published the other hosts' payloads")
        return (), "every host's leader noted its arrival"

    def _note(self, key: str) -> str:
        return self._store.get(key).decode() if self._store.check([key]) else ""

    @staticmethod
    def _waiting_for(note: str, gen: int) -> list[tuple[int, int]]:
        """(rank, last generation) pairs of a leader's waiting note, if it is about `gen`."""
        at, _, ranks = note.partition(";")
        if not ranks or int(at) != gen:
            return []
        return [(int(r), int(g)) for r, g in (item.split(":") for item in ranks.split(","))]

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
