"""Rendezvous: the two all-rank CPU control phases of a turnstile round, `pre_d` and `post_d`.

Contract shared by every implementation:

- Every rank calls `pre_d()` then `post_d()` once per round, in that order; idle ranks make the same
  no-work calls. A call returns once every rank of the group has made the same call (a barrier).
- A phase may carry a small payload, up to `MAX_PAYLOAD` ints per rank (for example each rank's
  queued P tokens, so that all ranks open a P epoch in the same round); after the phase,
  `payloads[r]` is what rank `r` sent (empty tuple if nothing). Phases enqueue no device
  collective and never wait on device events or stream synchronization: P work already submitted
  keeps running.
- Every wait has a timeout. On timeout the call raises `RendezvousTimeout` naming this rank, the
  phase, the round and the ranks that never arrived; the rendezvous is then unusable (`close` it).
- One thread per rank calls the rendezvous (the D thread); it is not meant for concurrent calls.

Implementations: `GlooRendezvous` (a torch.distributed gloo group; works across hosts) and
`ShmRendezvous` (one shared-memory page; ranks on one host; tens of microseconds).
`NullRendezvous` serves a single rank.
"""

from __future__ import annotations

import abc
import mmap
import os
import time
import uuid
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from vllm_ainfer_pd.turnstile.errors import (
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
)

PHASES = ("pre_d", "post_d")
# The P lane's DP round sends 4 (its next epoch's tokens and the 3 load figures). ShmRendezvous
# keeps a rank's generation and two payload buffers in its 2 cache lines: 1 + 2 * (1 + 4) <= 16.
MAX_PAYLOAD = 4
Payload = tuple[int, ...]


def phase_of(gen: int) -> str:
    """Phase of arrival generation `gen = 2 * round + phase_index + 1`, e.g. "pre_d of round 3"."""
    return f"{PHASES[(gen - 1) % 2]} of round {(gen - 1) // 2}"


def describe_generation(gen: int) -> str:
    """Where a rank last arrived, from its generation (0: it never arrived)."""
    return "never arrived" if gen <= 0 else f"last arrived at {phase_of(gen)}"


class Rendezvous(abc.ABC):
    """Two-phase all-rank barrier; see the module docstring for the contract."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._gen = 0  # generations completed: 2 per round
        self._failure: RendezvousError | None = None
        self.payloads: list[Payload] = [() for _ in range(world_size)]

    @property
    def round(self) -> int:
        """The current round: the number of completed `post_d` calls."""
        return self._gen // 2

    def pre_d(self, payload: Payload = ()) -> float:
        """Barrier before D enqueue. Returns the seconds this rank waited."""
        return self._phase(0, payload)

    def post_d(self, payload: Payload = ()) -> float:
        """Barrier after D enqueue, before the next P release. Returns the seconds waited."""
        return self._phase(1, payload)

    def close(self) -> None:  # noqa: B027 - most rendezvous hold nothing to release
        """Release resources. Idempotent."""

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _phase(self, index: int, payload: Payload = ()) -> float:
        gen = self._gen + 1
        phase, rnd = PHASES[index], (gen - 1) // 2
        if self._failure is not None:
            raise RendezvousError("rendezvous unusable after an earlier failure", rank=self.rank,
                                  phase=phase, round=rnd, detail=str(self._failure))
        payload = tuple(int(v) for v in payload)
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"a rendezvous payload holds at most {MAX_PAYLOAD} ints, "
                             f"got {payload!r}")
        if (gen - 1) % 2 != index:
            raise RendezvousError("phase out of order", rank=self.rank, phase=phase, round=rnd,
                                  detail=f"expected {PHASES[(gen - 1) % 2]}")
        start = time.perf_counter()
        try:
            self.payloads = self._wait_all(gen, phase, rnd, payload)
        except RendezvousError as exc:
            self._failure = exc
            raise
        self._gen = gen
        return time.perf_counter() - start

    @abc.abstractmethod
    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        """Arrive at generation `gen` with `payload` and return every rank's payload once every
        rank has arrived; raise RendezvousError."""


class NullRendezvous(Rendezvous):
    """The rendezvous of a single rank: counts rounds, never waits."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        super().__init__(0, 1, timeout_s)

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        return [payload]


# --- shared memory ----------------------------------------------------------------------------

_LINE = 8  # int64 words per 64-byte cache line: one line per rank avoids false sharing
_MAGIC = 0x4149_4E46_5250_4430  # marks a segment whose header is written


class ShmRendezvous(Rendezvous):
    """Generation-counter barrier in one shared-memory page, for ranks on one host.

    Layout: line 0 holds a header (magic, world size); lines `1 + 2r` and `2 + 2r` belong to rank
    `r`: its arrival slot (the last generation it reached) and two payload buffers, one per
    generation parity. A rank arrives by storing its generation into its own slot (an
    aligned 8-byte store) and waits until every slot holds at least that generation. Slots only
    grow, so no reset or sense flag is needed, and on timeout the slots name the missing ranks.

    The creator (rank 0 unless `create` says otherwise) makes the segment named `name` and unlinks
    it on `close`; the others attach, retrying until `timeout_s`. `name` must be unique per job (see
    `from_group`). Ranks here are local indices `0 .. world_size - 1`. Threads of one process may
    each hold their own instance (used by tests).

    Waiting spins for `spin_s`, then yields the CPU (`sched_yield`), then sleeps ~50 us per check
    after `yield_s`, so long skews do not starve the late ranks. `spin_s=None` spins 50 us when
    every rank can have a CPU and not at all when ranks outnumber the CPUs this process may use
    (there, a spinning rank only delays the rank it waits for).
    """

    def __init__(self, name: str, rank: int, world_size: int, *, create: bool | None = None,
                 timeout_s: float = 60.0, spin_s: float | None = None,
                 yield_s: float = 5e-4) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} out of range for world_size {world_size!r}")
        super().__init__(rank, world_size, timeout_s)
        self.name = name
        if spin_s is None:
            spin_s = 50e-6 if world_size <= len(os.sched_getaffinity(0)) else 0.0
        self.spin_s, self.yield_s = spin_s, yield_s
        self._creator = rank == 0 if create is None else create
        size = _LINE * 8 * (2 * world_size + 1)
        self._shm: SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if self._creator:
            self._shm = SharedMemory(name=name, create=True, size=size)
            self._view = self._shm.buf.cast("q")
            self._view[1] = world_size
            self._view[0] = _MAGIC  # written last: attachers wait for it
        else:
            self._view = self._attach(name, size)
        self._slots = [(1 + 2 * r) * _LINE for r in range(world_size)]
        self._mine = self._slots[rank]

    @classmethod
    def from_group(cls, group: Any = None, *, timeout_s: float = 60.0) -> ShmRendezvous:
        """Collective over a torch.distributed `group` whose ranks share one host: the group's
        first rank picks a unique name and creates the segment; local rank = group rank."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        me = ranks.index(dist.get_rank())
        box = [f"ainfer_pd_rdv_{uuid.uuid4().hex[:16]}" if me == 0 else None]
        dist.broadcast_object_list(box, src=ranks[0], group=group)
        return cls(str(box[0]), me, len(ranks), timeout_s=timeout_s)

    def _attach(self, name: str, size: int) -> memoryview:
        # Attach through /dev/shm rather than SharedMemory(create=False): before Python 3.13 the
        # latter registers the segment with the resource tracker, which would unlink the creator's
        # segment when this process exits (and warn twice when it is the same process).
        path = os.path.join("/dev/shm", name.lstrip("/"))
        deadline = time.monotonic() + self.timeout_s
        while True:
            view = self._try_attach(path, size)
            if view is not None:
                return view
            if time.monotonic() > deadline:
                raise RendezvousTimeout("shared-memory segment never appeared", rank=self.rank,
                                        phase="attach", round=0, missing=(0,),
                                        detail=f"segment {name!r}; waited {self.timeout_s:.3g} s")
            time.sleep(1e-3)

    def _try_attach(self, path: str, size: int) -> memoryview | None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            have = os.fstat(fd).st_size
            if have < _LINE * 8:
                return None  # the creator has not sized it yet
            with mmap.mmap(fd, _LINE * 8) as header_map:
                header = memoryview(header_map).cast("q")
                magic, world = header[0], header[1]
                header.release()
            if magic != _MAGIC:
                return None  # the creator has not written the header yet
            if world != self.world_size or have < size:
                raise ValueError(f"segment {path!r} was made for world_size {world}, "
                                 f"not {self.world_size}")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return memoryview(self._mmap).cast("q")

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        view, slots = self._view, self._slots
        # Payload words by generation parity: a rank can be at most one generation ahead of the
        # slowest reader, so the other parity's words are never overwritten while being read.
        base = self._mine + 1 + (gen % 2) * (1 + MAX_PAYLOAD)
        view[base] = len(payload)
        for i, value in enumerate(payload):
            view[base + 1 + i] = value
        view[self._mine] = gen  # published last (x86 stores are not reordered with each other)
        start = time.monotonic()
        while True:
            for slot in slots:
                if view[slot] < gen:
                    break
            else:
                return [self._read_payload(slot, gen) for slot in slots]
            waited = time.monotonic() - start
            if waited < self.spin_s:
                continue
            if waited > self.timeout_s:
                self._raise_timeout(gen, phase, rnd)
            if waited < self.yield_s:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def _read_payload(self, slot: int, gen: int) -> Payload:
        base = slot + 1 + (gen % 2) * (1 + MAX_PAYLOAD)
        n = self._view[base]
        return tuple(self._view[base + 1 + i] for i in range(n))

    def _raise_timeout(self, gen: int, phase: str, rnd: int) -> None:
        late = {r: self._view[s] for r, s in enumerate(self._slots) if self._view[s] < gen}
        detail = "; ".join(f"rank {r} {describe_generation(g)}" for r, g in late.items())
        raise RendezvousTimeout(f"rendezvous timed out after {self.timeout_s:.3g} s",
                                rank=self.rank, phase=phase, round=rnd,
                                missing=tuple(late), detail=detail)

    def close(self) -> None:
        view = getattr(self, "_view", None)
        if view is not None:
            view.release()
            self._view = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self._shm is not None:
            self._shm.close()
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None


# --- torch.distributed gloo -------------------------------------------------------------------


class GlooRendezvous(Rendezvous):
    """Barrier as one small CPU all-gather on a gloo process group (works across hosts).

    Each phase all-gathers `[gen, payload length, payload...]`, so the barrier also checks that
    every rank stood in the same phase of the same round (`RendezvousMismatch` otherwise). Before
    the all-gather a
    rank notes its generation in the group's key-value store (one small `set`); that note carries
    nothing the protocol uses, but lets a rank that times out name the peers that never arrived,
    which the all-gather alone cannot (if the store's host rank has already exited, the error
    says the store is unreachable instead). Ranks are global ranks. After an error the group may
    be left with a pending collective: treat it as fatal for the job.

    `group` defaults to the world group; it must use the gloo backend. `store` defaults to the
    default group's store.
    """

    def __init__(self, group: Any = None, *, store: Any = None, timeout_s: float = 60.0,
                 name: str = "turnstile") -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._group = group if group is not None else dist.group.WORLD
        self._ranks = dist.get_process_group_ranks(self._group)
        super().__init__(dist.get_rank(), len(self._ranks), timeout_s)
        if store is None:
            # Private accessor, used because torch offers no public handle on the default store.
            store = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"ainfer_pd/rdv/{name}/", store)
        self._torch = torch
        # Per rank: [generation, payload length, payload...]; gathered from every rank.
        width = 2 + MAX_PAYLOAD
        self._buf = torch.zeros(width, dtype=torch.int64)
        self._gathered = [torch.zeros(width, dtype=torch.int64) for _ in self._ranks]
        self._timeout = timedelta(seconds=timeout_s)

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        dist = self._dist
        self._store.set(str(self.rank), str(gen))
        self._buf.zero_()
        self._buf[0], self._buf[1] = gen, len(payload)
        for i, value in enumerate(payload):
            self._buf[2 + i] = value
        start = time.monotonic()
        try:
            work = dist.all_gather(self._gathered, self._buf, group=self._group, async_op=True)
            work.wait(self._timeout)
        except RuntimeError as exc:
            waited = time.monotonic() - start
            timed_out = "timed out" in str(exc).lower() or waited >= 0.99 * self.timeout_s
            cls = RendezvousTimeout if timed_out else RendezvousError
            missing, detail = self._late_ranks(gen)
            raise cls(f"rendezvous {'timed out' if timed_out else 'failed'} after {waited:.3g} s",
                      rank=self.rank, phase=phase, round=rnd, missing=missing,
                      detail=f"{detail}; gloo: {exc}") from exc
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
