"""The shared-memory segment of the ranks of one host, which `ShmRendezvous` and
`HierarchicalRendezvous` both meet in."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.shared_memory import SharedMemory
from typing import NoReturn, TypeVar

from vllm_ainfer_pd.turnstile.errors import RendezvousTimeout
from vllm_ainfer_pd.turnstile.rendezvous.base import MAX_PAYLOAD, Payload

T = TypeVar("T")

_LINE = 8  # int64 words per 64-byte cache line: one line per rank avoids false sharing
_MAGIC = 0x4149_4E46_5250_4431  # marks a segment whose header is written (format 1: tagged words)
_GAVE_UP = 3  # header word: 0, or (generation << 16 | local rank + 1) of the first to give up
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


class HostSegment:
    """Arrival slots and payload buffers of the ranks of one host, in one shared-memory segment.

    Layout: line 0 holds a header (magic, world size, board size, the give-up mark); lines `1 + 2r`
    and `2 + 2r` belong to local rank `r`: its arrival slot (the last generation it reached) and two
    payload buffers, one per generation parity. `arrive` writes this rank's payload buffer, then
    stores its generation into its own slot; `gather` returns every rank's payload once every slot
    holds at least that generation. Slots only grow, so no reset or sense flag is needed, and `late`
    names the ranks a wait is missing. `board` appends two parity buffers of `board` payloads each,
    where one rank (a host's leader) publishes payloads to the host (`post_board`, `read_board`).

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
    depends (by a branch) on the loaded values, which Arm does not let a store overtake. The board
    keeps the same argument as long as its writer posts `g + 2` only after every reader arrived
    at `g + 2`.

    The creator (local rank 0 unless `create` says otherwise) makes the segment named `name` and
    unlinks it on `close`; the others attach, retrying until `timeout_s`. `name` must be unique
    per job. Ranks here are local indices `0 .. world_size - 1`. Threads of one process may each
    hold their own instance (used by tests).

    Giving up. A rank whose wait times out marks the segment before it raises (`give_up`), and
    every wait, this rank's included, checks the mark before it looks at the slots: a rank that
    arrives after a peer gave up fails at once, naming that peer and where it gave up, instead of
    finding every slot full and going on into D's collectives, where its peer never comes (and no
    timeout of this package guards the wait). The mark is written once and never cleared: the
    rendezvous is unusable after a timeout anyway. It narrows the race rather than closing it: a
    rank that completed its check just before the mark appeared still goes on.

    `wait` spins for `spin_s`, then yields the CPU (`sched_yield`), then sleeps ~50 us per check
    after `yield_s`, so long skews do not starve the late ranks. `spin_s=None` spins 50 us when
    every rank can have a CPU and not at all when ranks outnumber the CPUs this process may use
    (there, a spinning rank only delays the rank it waits for).
    """

    def __init__(self, name: str, rank: int, world_size: int, *, timeout_s: float,
                 create: bool | None = None, spin_s: float | None = None,
                 yield_s: float = 5e-4, board: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} out of range for world_size {world_size!r}")
        if board < 0:
            raise ValueError(f"board must be >= 0, got {board!r}")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.timeout_s = timeout_s
        if spin_s is None:
            spin_s = 50e-6 if world_size <= len(os.sched_getaffinity(0)) else 0.0
        self.spin_s, self.yield_s = spin_s, yield_s
        self.board = board
        self._board_base = _LINE * (1 + 2 * world_size)
        size = 8 * (self._board_base + 2 * board * _WORDS)
        self._shm: SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None
        creator = rank == 0 if create is None else create
        if creator:
            self._shm = SharedMemory(name=name, create=True, size=size)
            self._view = self._shm.buf.cast("q")
            self._view[1] = world_size
            self._view[2] = board
            self._view[0] = _MAGIC  # written last: attachers wait for it
        else:
            self._view = self._attach(name, size)
        self._slots = [(1 + 2 * r) * _LINE for r in range(world_size)]
        self._mine = self._slots[rank]

    # --- the steps of a wait ---

    def arrive(self, gen: int, payload: Payload) -> None:
        """Publish this rank's `payload` of generation `gen`, then its arrival at `gen`."""
        self._write(self._buffer(self._mine, gen), gen, payload)
        self._view[self._mine] = gen

    def gather(self, gen: int) -> list[Payload] | None:
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

    def late(self, gen: int) -> dict[int, int]:
        """Local ranks whose slot is below `gen`, with the generation each last reached."""
        view = self._view
        return {r: view[s] for r, s in enumerate(self._slots) if view[s] < gen}

    def post_board(self, gen: int, payloads: Sequence[Payload]) -> None:
        """Publish `board` payloads of `gen` on the board (one writer per segment)."""
        for r, payload in enumerate(payloads):
            self._write(self._board_buffer(gen, r), gen, payload)

    def read_board(self, gen: int) -> list[Payload] | None:
        """The board's payloads of `gen`, or None until all of them show."""
        out = []
        for r in range(self.board):
            payload = self._read(self._board_buffer(gen, r), gen)
            if payload is None:
                return None
            out.append(payload)
        return out

    def give_up(self, gen: int) -> None:
        """Mark the segment: this rank gave up waiting at `gen` (the first mark stays)."""
        if self._view[_GAVE_UP] == 0:
            self._view[_GAVE_UP] = (gen << 16) | (self.rank + 1)

    def gave_up(self) -> tuple[int, int] | None:
        """(local rank, generation) of the rank that gave up waiting, or None."""
        mark = self._view[_GAVE_UP]
        return None if mark == 0 else ((mark & 0xFFFF) - 1, mark >> 16)

    def wait(self, gen: int, ready: Callable[[], T | None],
             timed_out: Callable[[float], NoReturn],
             peer_gave_up: Callable[[int, int], NoReturn]) -> T:
        """Poll `ready` until it returns a value. After `timeout_s`, mark the segment
        (`give_up(gen)`) and call `timed_out(waited)`; once any rank has marked it, call
        `peer_gave_up(local rank, its generation)` instead of polling."""
        start = time.monotonic()
        view = self._view
        while True:
            if view[_GAVE_UP] != 0:
                peer_gave_up(*self.gave_up())
            got = ready()
            if got is not None:
                return got
            waited = time.monotonic() - start
            if waited < self.spin_s:
                continue
            if waited > self.timeout_s:
                self.give_up(gen)
                timed_out(waited)
            if waited < self.yield_s:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def close(self) -> None:
        """Detach; the creator also unlinks the segment. Idempotent."""
        if self._view is not None:
            self._view.release()
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

    # --- words and buffers ---

    def _buffer(self, slot: int, gen: int) -> int:
        # Payload words by generation parity: a rank can be at most one generation ahead of the
        # slowest reader, so the other parity's words are never overwritten while being read.
        return slot + 1 + (gen % 2) * _WORDS

    def _board_buffer(self, gen: int, rank: int) -> int:
        return self._board_base + ((gen % 2) * self.board + rank) * _WORDS

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

    # --- attaching ---

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
