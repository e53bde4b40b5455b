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
"""

from __future__ import annotations

import abc
import time

from vllm_ainfer_pd.turnstile.errors import RendezvousError

PHASES = ("pre_d", "post_d")
# The P lane's DP round sends 4 (its next epoch's tokens and the 3 load figures). A host segment
# keeps a rank's generation and two payload buffers in its 2 cache lines: 1 + 2 * (1 + 4) <= 16.
MAX_PAYLOAD = 4
# Shared memory packs a 16-bit generation tag beside each value in one 64-bit word (see
# host_segment.py), which leaves 48 bits. Every implementation enforces the same range, so a job
# tried on one host cannot fail only once it spans several.
PAYLOAD_MIN = -(1 << 47)
PAYLOAD_MAX = (1 << 47) - 1
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
