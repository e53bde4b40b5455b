"""Errors raised by the turnstile protocol.

Every error names the rank that detected it and the protocol coordinates at which it happened
(epoch and boundary for the segment controller; phase and round for the rendezvous), so that a log
line from one rank of a hung job says where that rank stood and whom it was waiting for.
"""

from __future__ import annotations


class TurnstileError(RuntimeError):
    """Base class of every error raised by `vllm_ainfer_pd.turnstile`."""


# --- segment controller -----------------------------------------------------------------------


class ProtocolError(TurnstileError):
    """A segment-controller rule was broken. Carries `rank`, `epoch` and `boundary`."""

    def __init__(self, what: str, *, rank: int, epoch: int | None, boundary: float | None = None,
                 detail: str = "") -> None:
        self.rank = rank
        self.epoch = epoch
        self.boundary = boundary
        where = f"rank {rank}, epoch {epoch}"
        if boundary is not None:
            where += f", boundary {_fmt(boundary)}"
        super().__init__(f"{what} ({where})" + (f": {detail}" if detail else ""))


class StaleEpochError(ProtocolError):
    """An epoch id that is not newer than the last opened one, or not the open one."""


class EpochActiveError(ProtocolError):
    """A new epoch was opened while the previous one had not finished (one P epoch at a time)."""


class SecondProducerError(ProtocolError):
    """A second producer tried to publish boundaries of an epoch that already has one."""


class MissingProducerError(ProtocolError):
    """The consumer waited for a boundary that nobody published within the timeout."""


class NonMonotoneBoundaryError(ProtocolError):
    """A boundary id that repeats, goes back, skips an id, or follows completion."""


class PermitExceededError(ProtocolError):
    """A boundary published beyond the current permit endpoint (P ran past its stop)."""


class PrematureAdvanceError(ProtocolError):
    """The permit was moved while P was still running toward it (D's insertion point would move)."""


class PermitTimeout(ProtocolError):
    """The producer waited at its endpoint for a permit that never came within the timeout."""


class EpochCancelled(ProtocolError):
    """The epoch was cancelled while the producer was running or parked."""


class ProducerFailed(ProtocolError):
    """The producer reported a failure; the original exception is the `__cause__`."""


class DrainTimeout(ProtocolError):
    """An ended epoch's P did not stop in time: its thread did not exit, its device work did not
    complete, or its expert-parallel state could not be rebuilt (a peer left a collective
    half-issued). Its KV blocks are not freed: the engine must stop."""


# --- rendezvous -------------------------------------------------------------------------------


class RendezvousError(TurnstileError):
    """A rendezvous failed. Carries `rank`, `phase`, `round` and `missing` (ranks never arrived)."""

    def __init__(self, what: str, *, rank: int, phase: str, round: int,
                 missing: tuple[int, ...] = (), detail: str = "") -> None:
        self.rank = rank
        self.phase = phase
        self.round = round
        self.missing = tuple(missing)
        msg = f"{what}: rank {rank} in {phase} of round {round}"
        if self.missing:
            msg += f"; ranks that never arrived: {list(self.missing)}"
        super().__init__(msg + (f"; {detail}" if detail else ""))


class RendezvousTimeout(RendezvousError):
    """A rank waited longer than the timeout for its peers to reach the same phase."""


class RendezvousAbandoned(RendezvousTimeout):
    """A peer timed out in this rendezvous, so this rank stops waiting too; if this rank arrived
    after that, going on would take it into collectives its peer never joins."""


class RendezvousMismatch(RendezvousError):
    """Ranks met in the same collective while standing in different phases or rounds."""


def _fmt(boundary: float) -> str:
    return "inf" if boundary == float("inf") else str(int(boundary))
