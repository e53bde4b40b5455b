"""Rendezvous: the two all-rank CPU control phases of a turnstile round, `pre_d` and `post_d`.

Contract shared by every implementation:

- Every rank calls `pre_d()` then `post_d()` once per round, in that order; idle ranks make the same
  no-work calls. A call returns once every rank of the group has made the same call (a barrier).
- A phase may carry a small payload, up to `MAX_PAYLOAD` ints per rank, each in
  `[PAYLOAD_MIN, PAYLOAD_MAX]` (48-bit signed; for example each rank's queued P tokens, so that all
  ranks open a P epoch in the same round); after the phase, `payloads[r]` is what group rank `r`
  sent (empty tuple if nothing). Phases enqueue no device collective and never wait on device
  events or stream synchronization: P work already submitted keeps running.
- Every wait has a timeout. On timeout the call raises `RendezvousTimeout` naming this rank, the
  phase, the round and the ranks that never arrived; the rendezvous is then unusable (`close` it).
- One thread per rank calls the rendezvous (the D thread); it is not meant for concurrent calls.

Implementations: `ShmRendezvous` (one shared-memory segment; ranks on one host; tens of
microseconds), `HierarchicalRendezvous` (shared memory within each host, one leader per host over a
gloo group across hosts), `GlooRendezvous` (one gloo all-gather; any layout) and `NullRendezvous`
(a single rank). `make_rendezvous` picks one from where the ranks run.
"""

from __future__ import annotations

import abc
import mmap
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NoReturn, TypeVar

from vllm_ainfer_pd.turnstile.errors import (
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
)

PHASES = ("pre_d", "post_d")
# The P lane's DP round sends 4 (its next epoch's tokens and the 3 load figures). ShmRendezvous
# keeps a rank's generation and two payload buffers in its 2 cache lines: 1 + 2 * (1 + 4) <= 16.
MAX_PAYLOAD = 4
# Shared memory packs a 16-bit generation tag beside each value in one 64-bit word (see
# ShmRendezvous), which leaves 48 bits. Every implementation enforces the same range, so a job
# tried on one host cannot fail only once it spans several.
PAYLOAD_MIN = -(1 << 47)
PAYLOAD_MAX = (1 << 47) - 1
Payload = tuple[int, ...]
T = TypeVar("T")


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
        if not all(PAYLOAD_MIN <= v <= PAYLOAD_MAX for v in payload):
            raise ValueError(f"rendezvous payload values must lie in [{PAYLOAD_MIN}, "
                             f"{PAYLOAD_MAX}] (48-bit signed), got {payload!r}")
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
_MAGIC = 0x4149_4E46_5250_4431  # marks a segment whose header is written (format 1: tagged words)
_WORDS = 1 + MAX_PAYLOAD  # one payload buffer: its length word, then MAX_PAYLOAD value words
_TAG_BITS = 16
_VALUE_BITS = 64 - _TAG_BITS
_TAG_MASK = (1 << _TAG_BITS) - 1
_VALUE_MASK = (1 << _VALUE_BITS) - 1


def _tagged(gen: int, value: int) -> int:
    """One self-validating word: generation `gen`'s 16-bit tag high, `value` (48-bit) low, as the
    signed int64 that a 'q' memoryview stores."""
    word = ((gen & _TAG_MASK) << _VALUE_BITS) | (value & _VALUE_MASK)
    return word - (1 << 64) if word >> 63 else word


def _untag(word: int, gen: int) -> int | None:
    """The value in `word` if it carries generation `gen`'s tag, else None (not yet written)."""
    if (word >> _VALUE_BITS) & _TAG_MASK != gen & _TAG_MASK:
        return None
    value = word & _VALUE_MASK
    return value - (1 << _VALUE_BITS) if value >> (_VALUE_BITS - 1) else value


class ShmRendezvous(Rendezvous):
    """Generation-counter barrier in one shared-memory segment, for ranks on one host.

    Layout: line 0 holds a header (magic, world size, board size); lines `1 + 2r` and `2 + 2r`
    belong to rank `r`: its arrival slot (the last generation it reached) and two payload buffers,
    one per generation parity. A rank arrives by writing its payload buffer, then storing its
    generation into its own slot, and waits until every slot holds at least that generation.
    Slots only grow, so no reset or sense flag is needed, and on timeout the slots name the
    missing ranks. `board` (for `HierarchicalRendezvous`) appends two parity buffers of `board`
    payloads each, where a host's leader publishes every rank's payload to the host.

    Memory ordering. Python has no fence, and only x86 keeps stores in order and loads in order;
    on Arm (GH200, GB200) a reader may see a rank's new slot before that rank's payload stores, or
    load a payload word before the slot. So no word relies on another being written first: every
    payload word (length and values) carries the generation it was written for, a 16-bit tag
    above the 48-bit value, and a reader takes a buffer only when each word it reads carries
    exactly the generation it awaits, spinning otherwise. This needs only that one word is never
    seen half-written: a 'q' memoryview reads and writes each element with one aligned 8-byte
    access, single-copy atomic on x86-64 and AArch64. The writer rewrites all words of a buffer
    each time, so a buffer only ever holds the words of generation `g - 2` (the previous use of
    that parity) and `g`, which two different 16-bit tags always tell apart, wrap-around included.
    A newer generation `g + 2` cannot be there yet: a rank writes it only after every rank
    arrived at `g + 1`, which a reader does only after its reads of `g` returned, and that store
    depends (by a branch) on the loaded values, which Arm does not let a store overtake.

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
                 yield_s: float = 5e-4, board: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} out of range for world_size {world_size!r}")
        if board < 0:
            raise ValueError(f"board must be >= 0, got {board!r}")
        super().__init__(rank, world_size, timeout_s)
        self.name = name
        if spin_s is None:
            spin_s = 50e-6 if world_size <= len(os.sched_getaffinity(0)) else 0.0
        self.spin_s, self.yield_s = spin_s, yield_s
        self.board = board
        self._creator = rank == 0 if create is None else create
        self._board_base = _LINE * (1 + 2 * world_size)
        size = 8 * (self._board_base + 2 * board * _WORDS)
        self._shm: SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if self._creator:
            self._shm = SharedMemory(name=name, create=True, size=size)
            self._view = self._shm.buf.cast("q")
            self._view[1] = world_size
            self._view[2] = board
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
                magic, world, board = header[0], header[1], header[2]
                header.release()
            if magic != _MAGIC:
                return None  # the creator has not written the header yet
            if world != self.world_size or board != self.board or have < size:
                raise ValueError(f"segment {path!r} was made for world_size {world}, "
                                 f"not {self.world_size} (board {board}, not {self.board})")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return memoryview(self._mmap).cast("q")

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        self._arrive(gen, payload)
        return self._spin(lambda: self._gather(gen),
                          lambda waited: self._raise_timeout(gen, phase, rnd))

    # The steps below are also HierarchicalRendezvous's, which runs them on its host's segment.

    def _buffer(self, slot: int, gen: int) -> int:
        # Payload words by generation parity: a rank can be at most one generation ahead of the
        # slowest reader, so the other parity's words are never overwritten while being read.
        return slot + 1 + (gen % 2) * _WORDS

    def _write(self, base: int, gen: int, payload: Payload) -> None:
        # Every word, used or not, so the buffer never keeps a tag older than `gen - 2` (see the
        # class docstring); the order of the stores does not matter.
        view = self._view
        view[base] = _tagged(gen, len(payload))
        for i in range(MAX_PAYLOAD):
            view[base + 1 + i] = _tagged(gen, payload[i] if i < len(payload) else 0)

    def _read(self, base: int, gen: int) -> Payload | None:
        """The payload written at `base` for `gen`, or None while any word read is not yet."""
        view = self._view
        n = _untag(view[base], gen)
        if n is None:
            return None
        values = []
        for i in range(n):
            value = _untag(view[base + 1 + i], gen)
            if value is None:
                return None
            values.append(value)
        return tuple(values)

    def _arrive(self, gen: int, payload: Payload) -> None:
        self._write(self._buffer(self._mine, gen), gen, payload)
        self._view[self._mine] = gen

    def _gather(self, gen: int) -> list[Payload] | None:
        """Every rank's payload of `gen`, or None until every rank arrived and its words show."""
        view = self._view
        for slot in self._slots:
            if view[slot] < gen:
                return None
        out = []
        for slot in self._slots:
            payload = self._read(self._buffer(slot, gen), gen)
            if payload is None:
                return None
            out.append(payload)
        return out

    def _board_buffer(self, gen: int, rank: int) -> int:
        return self._board_base + ((gen % 2) * self.board + rank) * _WORDS

    def _post_board(self, gen: int, payloads: Sequence[Payload]) -> None:
        for r, payload in enumerate(payloads):
            self._write(self._board_buffer(gen, r), gen, payload)

    def _read_board(self, gen: int) -> list[Payload] | None:
        out = []
        for r in range(self.board):
            payload = self._read(self._board_buffer(gen, r), gen)
            if payload is None:
                return None
            out.append(payload)
        return out

    def _late(self, gen: int) -> dict[int, int]:
        """Local ranks whose slot is below `gen`, with the generation each last reached."""
        view = self._view
        return {r: view[s] for r, s in enumerate(self._slots) if view[s] < gen}

    def _spin(self, ready: Callable[[], T | None], timed_out: Callable[[float], NoReturn]) -> T:
        """Poll `ready` until it returns a value; call `timed_out(waited)` after `timeout_s`."""
        start = time.monotonic()
        while True:
            got = ready()
            if got is not None:
                return got
            waited = time.monotonic() - start
            if waited < self.spin_s:
                continue
            if waited > self.timeout_s:
                timed_out(waited)
            if waited < self.yield_s:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def _raise_timeout(self, gen: int, phase: str, rnd: int) -> NoReturn:
        late = self._late(gen)
        detail = "; ".join(f"rank {r} {describe_generation(g)}" for r, g in late.items())
        if not late:
            # Every slot moved on but some payload word never showed this generation's tag:
            # something other than this job's ranks wrote into the segment.
            detail = (f"every rank arrived, but payload words never carried generation {gen} "
                      f"(segment {self.name!r} overwritten?)")
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


def _all_gather_or_raise(rdv: Rendezvous, gathered: list, tensor: Any, group: Any, phase: str,
                         rnd: int, missing: Any) -> None:
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

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        self._store.set(str(self.rank), str(gen))
        self._buf.zero_()
        self._buf[0], self._buf[1] = gen, len(payload)
        for i, value in enumerate(payload):
            self._buf[2 + i] = value
        _all_gather_or_raise(self, self._gathered, self._buf, self._group, phase, rnd,
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


# --- several hosts: shared memory within each, gloo between their leaders ----------------------


def _by_host(hosts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """(host, its ranks ascending) for each host, hosts in the order of their lowest rank."""
    out: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return list(out.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as runs, e.g. [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class HierarchicalRendezvous(Rendezvous):
    """Barrier for ranks on several hosts: shared memory among the ranks of each host, and one
    gloo all-gather among the hosts' leaders.

    Per phase, every rank arrives in its host's `ShmRendezvous` segment. The host's leader (its
    lowest rank) waits for the host's ranks, all-gathers their payloads with the other leaders over
    a gloo group of the leaders, and publishes every rank's payload on the segment's board, where
    the host's other ranks read them (with the same self-validating words, see `ShmRendezvous`).
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
        self._hosts = _by_host(hosts)
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
        self._width = 2 + max(len(rs) for _, rs in self._hosts) * _WORDS
        self._gathered = [torch.zeros(self._width, dtype=torch.int64) for _ in self._hosts]
        self._shm: ShmRendezvous | None = None
        if len(self._local) > 1:
            try:
                self._shm = ShmRendezvous(f"{name}_h{self._host}", self._local.index(self.rank),
                                          len(self._local), timeout_s=timeout_s, spin_s=spin_s,
                                          board=self.world_size)
            except RendezvousTimeout as exc:
                raise RendezvousTimeout("host's shared-memory segment never appeared",
                                        rank=self.rank, phase="attach", round=0,
                                        missing=(self.leader,),
                                        detail=f"leader rank {self.leader} did not create it "
                                        f"within {timeout_s:.3g} s") from exc

    def _wait_all(self, gen: int, phase: str, rnd: int, payload: Payload) -> list[Payload]:
        shm = self._shm
        if shm is None:  # a host of one rank: its leader alone
            return self._exchange(gen, phase, rnd, [payload])

        def timed_out(waited: float) -> NoReturn:
            self._raise_timeout(gen, phase, rnd)

        shm._arrive(gen, payload)
        if self.rank != self.leader:
            return shm._spin(lambda: shm._read_board(gen), timed_out)
        since = time.monotonic()
        local = shm._spin(lambda: self._gather_host(gen, since), timed_out)
        payloads = self._exchange(gen, phase, rnd, local)
        shm._post_board(gen, payloads)
        return payloads

    def _gather_host(self, gen: int, since: float) -> list[Payload] | None:
        assert self._shm is not None
        got = self._shm._gather(gen)
        if got is None:
            now = time.monotonic()
            if now >= since + self._note_after and now >= self._next_note:
                self._next_note = now + 0.25
                self._note_waiting(gen)
        return got

    def _note_waiting(self, gen: int) -> None:
        """Leave in the store which of this host's ranks the leader waits for at `gen`, so that
        other hosts' ranks that time out can name them."""
        assert self._shm is not None
        late = self._shm._late(gen)
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
        _all_gather_or_raise(self, self._gathered, torch.tensor(row, dtype=torch.int64),
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
                base = 2 + i * _WORDS
                payloads[rank] = tuple(r[base + 1 : base + 1 + r[base]])
        return payloads

    def _raise_timeout(self, gen: int, phase: str, rnd: int) -> NoReturn:
        if self._shm is not None and self.rank == self.leader:
            self._next_note = 0.0
            self._note_waiting(gen)  # the latest word on this host for peers still waiting
        missing, detail = self._missing(gen)
        raise RendezvousTimeout(f"rendezvous timed out after {self.timeout_s:.3g} s",
                                rank=self.rank, phase=phase, round=rnd, missing=missing,
                                detail=detail)

    def _missing(self, gen: int) -> tuple[tuple[int, ...], str]:
        """The ranks (or hosts) that keep this rank waiting at `gen`, and where each stood."""
        if self._shm is not None:
            late = self._shm._late(gen)
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
                    notes.append(f"host {host!r} (ranks {_ranks_text(ranks)}, leader rank "
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
        if self._shm is not None:
            self._shm.close()
            self._shm = None


# --- choosing one ------------------------------------------------------------------------------

RENDEZVOUS_KINDS = ("auto", "shm", "gloo")
HOST_ID_ENV = "VLLM_AINFER_PD_HOST_ID"


def host_identity() -> str:
    """This rank's host, for grouping ranks that can share memory: `$VLLM_AINFER_PD_HOST_ID`
    when set (e.g. to run several "hosts" on one machine), else the hostname with the boot id
    and the device of /dev/shm, where readable."""
    override = os.environ.get(HOST_ID_ENV, "").strip()
    if override:
        return override
    # A hostname alone can repeat across machines (cloned images, pods on the host network) and
    # two containers on one machine may each have their own /dev/shm; the boot id tells machines
    # apart and /dev/shm's device the shared-memory filesystems of one machine.
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f"boot {f.read().strip()[:8]}")
    except OSError:
        pass
    try:
        dev = os.stat("/dev/shm").st_dev
        parts.append(f"/dev/shm {os.major(dev)}:{os.minor(dev)}")
    except OSError:
        pass
    name = socket.gethostname()
    return f"{name} ({', '.join(parts)})" if parts else name


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
    by_host = _by_host(hosts)
    if len(by_host) == 1:
        return "shm"
    if kind == "shm":
        where = "; ".join(f"host {h!r}: ranks {_ranks_text(rs)}" for h, rs in by_host)
        raise ValueError(f"rendezvous 'shm' needs all ranks on one host, but the {len(hosts)} "
                         f"ranks are on {len(by_host)} hosts ({where}); use 'auto' (shared "
                         f"memory within each host, gloo between hosts) or 'gloo'")
    if all(len(rs) == 1 for _, rs in by_host):
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
