"""The ordering ladder: three ways to order D against a P epoch, with the same admission and state.

- `fine` (default): segment-level. Each round releases K boundary intervals; D enters at every
  permit endpoint. Neither side waits for device work.
- `global-enqueue`: one release per epoch. The permit becomes UNBOUNDED after the epoch's entry
  round, so D's next rendezvous acknowledges the whole epoch's host enqueue on every rank; no
  device wait.
- `global-complete`: as `global-enqueue`, and before that rendezvous each rank also waits for its P
  epoch to finish on the device (the `device_fence` hook of `Turnstile`), a whole-P GPU fence.

Only the span and the fence differ; epochs, boundaries, rendezvous and permits follow the same
rules, so the three modes are a matched control for boundary granularity.

- `free`: no ordering at all, for an engine of one rank (TP = DP = PP = 1), where P issues no
  collective and so has nothing to order against D: P runs its whole epoch without parking and
  D never waits for it (no rendezvous, no permit to reach). The device still orders what must be
  ordered: P's stream waits for D's work before each epoch, and D reads P's KV only once P's
  event completed (docs/worker.md).
"""

from __future__ import annotations

import enum

from vllm_ainfer_pd.turnstile.controller import UNBOUNDED
from vllm_ainfer_pd.turnstile.policy import Load, SegmentPolicy


class OrderingMode(str, enum.Enum):
    GLOBAL_COMPLETE = "global-complete"
    GLOBAL_ENQUEUE = "global-enqueue"
    FINE = "fine"
    FREE = "free"

    @classmethod
    def parse(cls, value: str | OrderingMode) -> OrderingMode:
        """Accept a mode or its name ("fine", "global-enqueue", "global-complete", "free")."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown ordering mode {value!r}; choose one of {choices}") from None

    @property
    def segmented(self) -> bool:
        """True when D may enter at every segment boundary (not only between epochs)."""
        return self is OrderingMode.FINE

    @property
    def waits_for_p(self) -> bool:
        """False in `free`: D never waits for P to stop, and no round meets the other ranks."""
        return self is not OrderingMode.FREE

    @property
    def fences_device(self) -> bool:
        """True when D waits for the P epoch's device completion before its rendezvous."""
        return self is OrderingMode.GLOBAL_COMPLETE

    def span(self, policy: SegmentPolicy, load: Load | None = None) -> float:
        """The span a release uses: `policy.span(load)` in `fine`; UNBOUNDED in the global modes
        and in `free`, which release the rest of the epoch at once and never consult the
        policy."""
        return policy.span(load) if self.segmented else UNBOUNDED
