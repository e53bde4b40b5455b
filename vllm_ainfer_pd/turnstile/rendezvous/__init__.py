"""Rendezvous: the two all-rank CPU control phases of a turnstile round, `pre_d` and `post_d`
(the contract is `base.py`'s docstring).

Module map, one kind per module: `base.py` (the contract, `Rendezvous`, `NullRendezvous` for a
single rank), `host_segment.py` (the shared-memory segment of one host's ranks), `shm.py`
(`ShmRendezvous`: ranks on one host; tens of microseconds), `gloo.py` (`GlooRendezvous`: one gloo
all-gather; any layout), `hierarchical.py` (`HierarchicalRendezvous`: shared memory within each
host, one leader per host over gloo across hosts), `hosts.py` (a rank's host identity) and
`choose.py` (`make_rendezvous` picks one from where the ranks run).
"""

from __future__ import annotations

from vllm_ainfer_pd.turnstile.rendezvous.base import (
    MAX_PAYLOAD,
    PAYLOAD_MAX,
    PAYLOAD_MIN,
    PHASES,
    NullRendezvous,
    Payload,
    Rendezvous,
)
from vllm_ainfer_pd.turnstile.rendezvous.choose import (
    RENDEZVOUS_KINDS,
    choose_rendezvous,
    make_rendezvous,
)
from vllm_ainfer_pd.turnstile.rendezvous.gloo import GlooRendezvous
from vllm_ainfer_pd.turnstile.rendezvous.hierarchical import HierarchicalRendezvous
from vllm_ainfer_pd.turnstile.rendezvous.host_segment import HostSegment
from vllm_ainfer_pd.turnstile.rendezvous.hosts import HOST_ID_ENV, host_identity
from vllm_ainfer_pd.turnstile.rendezvous.shm import ShmRendezvous

__all__ = [
    "HOST_ID_ENV",
    "MAX_PAYLOAD",
    "PAYLOAD_MAX",
    "PAYLOAD_MIN",
    "PHASES",
    "RENDEZVOUS_KINDS",
    "GlooRendezvous",
    "HierarchicalRendezvous",
    "HostSegment",
    "NullRendezvous",
    "Payload",
    "Rendezvous",
    "ShmRendezvous",
    "choose_rendezvous",
    "host_identity",
    "make_rendezvous",
]
