"""The turnstile protocol (paper, section 4): segment controller, rendezvous, segment policies,
selective stream route and ordering ladder. Knows nothing of vLLM; imports torch only where a
torch.distributed group or a CUDA stream is actually used.
"""

from __future__ import annotations

from vllm_ainfer_pd.turnstile.controller import (
    UNBOUNDED,
    SegmentController,
    SegmentStatus,
    TaskState,
)
from vllm_ainfer_pd.turnstile.errors import (
    DrainTimeout,
    EpochActiveError,
    EpochCancelled,
    MissingProducerError,
    NonMonotoneBoundaryError,
    PermitExceededError,
    PermitTimeout,
    PrematureAdvanceError,
    ProducerFailed,
    ProtocolError,
    RendezvousAbandoned,
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
    SecondProducerError,
    StaleEpochError,
    TurnstileError,
)
from vllm_ainfer_pd.turnstile.ladder import OrderingMode
from vllm_ainfer_pd.turnstile.policy import (
    FixedSpan,
    Load,
    LoadSelectedSpan,
    SegmentPolicy,
    WorkPerRoundSpan,
    make_policy,
)
from vllm_ainfer_pd.turnstile.rendezvous import (
    HOST_ID_ENV,
    RENDEZVOUS_KINDS,
    GlooRendezvous,
    HierarchicalRendezvous,
    NullRendezvous,
    Rendezvous,
    ShmRendezvous,
    choose_rendezvous,
    host_identity,
    make_rendezvous,
)
from vllm_ainfer_pd.turnstile.route import RouteDecision, StreamRoute, crosses
from vllm_ainfer_pd.turnstile.turnstile import RoundRecord, Turnstile

__all__ = [
    "DrainTimeout",
    "HOST_ID_ENV",
    "RENDEZVOUS_KINDS",
    "UNBOUNDED",
    "EpochActiveError",
    "EpochCancelled",
    "FixedSpan",
    "GlooRendezvous",
    "HierarchicalRendezvous",
    "Load",
    "LoadSelectedSpan",
    "MissingProducerError",
    "NonMonotoneBoundaryError",
    "NullRendezvous",
    "OrderingMode",
    "PermitExceededError",
    "PermitTimeout",
    "PrematureAdvanceError",
    "ProducerFailed",
    "ProtocolError",
    "Rendezvous",
    "RendezvousError",
    "RendezvousMismatch",
    "RendezvousAbandoned",
    "RendezvousTimeout",
    "RoundRecord",
    "RouteDecision",
    "SecondProducerError",
    "SegmentController",
    "SegmentPolicy",
    "SegmentStatus",
    "ShmRendezvous",
    "StaleEpochError",
    "StreamRoute",
    "TaskState",
    "Turnstile",
    "TurnstileError",
    "WorkPerRoundSpan",
    "choose_rendezvous",
    "crosses",
    "host_identity",
    "make_policy",
    "make_rendezvous",
]
