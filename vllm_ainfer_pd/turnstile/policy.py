"""Segment policies: how many boundary intervals (the span K) one turnstile round admits.

A policy only chooses K. It never changes the order of anything: the same epoch checks, the same
rendezvous sequence and the same permit arithmetic apply whatever K is. All ranks must obtain the
same K in the same round (otherwise their P endpoints differ and their collectives mismatch), so a
policy must be fed rank-shared load figures, e.g. ones derived from the DP-synchronised batch.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_ainfer_pd.turnstile.controller import validate_span


@dataclass(frozen=True)
class Load:
    """Rank-shared load figures for one round.

    `d_occupancy`: fraction of D batch slots in use, in [0, 1].
    `p_pressure`: queued P work relative to its budget (e.g. queued P tokens / P token budget),
    finite and >= 0; 1.0 means one full budget is waiting.
    `epoch_size`: the P epoch this round releases (the open one, or the one about to open), in
    the same unit: its prompt tokens / the step's token budget, finite and >= 0.
    """

    d_occupancy: float = 0.0
    p_pressure: float = 0.0
    epoch_size: float = 0.0

    def __post_init__(self) -> None:
        _check_real("d_occupancy", self.d_occupancy)
        _check_real("p_pressure", self.p_pressure)
        _check_real("epoch_size", self.epoch_size)
        if not 0.0 <= self.d_occupancy <= 1.0:
            raise ValueError(f"d_occupancy must be in [0, 1], got {self.d_occupancy!r}")
        if self.p_pressure < 0.0:
            raise ValueError(f"p_pressure must be finite and >= 0, got {self.p_pressure!r}")
        if self.epoch_size < 0.0:
            raise ValueError(f"epoch_size must be finite and >= 0, got {self.epoch_size!r}")


class SegmentPolicy(abc.ABC):
    """Chooses the span K (a positive int) for the next release."""

    @abc.abstractmethod
    def span(self, load: Load | None = None) -> int:
        """K for the next round; `load` may be None for policies that ignore it."""


@dataclass(frozen=True)
class FixedSpan(SegmentPolicy):
    """Always the same span `k` (>= 1)."""

    k: int = 1

    def __post_init__(self) -> None:
        validate_span(self.k, what="k")
        if math.isinf(self.k):
            raise ValueError(f"k must be finite (use a global ordering mode), got {self.k!r}")

    def span(self, load: Load | None = None) -> int:
        return self.k


@dataclass(frozen=True)
class LoadSelectedSpan(SegmentPolicy):
    """Pick K from validated spans by D occupancy and P pressure.

    Rule, with the spans sorted `s_0 < s_1 < ... < s_m`:

    - `d_occupancy >= d_high`: `s_0`, the smallest span. D is busy, so stop P often to keep D's
      wait per round short.
    - otherwise: score `= min(p_pressure / p_high, 1) * (1 - d_occupancy / d_high)` in [0, 1] and
      K `= s_j` with `j = floor(score * m + 1/2)`. High P pressure with low D occupancy gives the
      largest span (fewer rounds, less control overhead while D has little to protect); no P
      pressure gives `s_0`.

    K never increases with D occupancy and never decreases with P pressure. `spans` are the spans
    validated for this backend and precision (the paper's selector picks among them).
    """

    spans: Sequence[int] = (1, 2, 4)
    d_high: float = 0.75
    p_high: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", _validated_spans(self.spans))
        _check_real("d_high", self.d_high)
        _check_real("p_high", self.p_high)
        if not 0.0 < self.d_high <= 1.0:
            raise ValueError(f"d_high must be in (0, 1], got {self.d_high!r}")
        if not self.p_high > 0.0:
            raise ValueError(f"p_high must be > 0, got {self.p_high!r}")

    def span(self, load: Load | None = None) -> int:
        if load is None:
            raise ValueError(f"{type(self).__name__} needs a Load, got None")
        spans = self.spans
        if load.d_occupancy >= self.d_high:
            return spans[0]
        score = min(load.p_pressure / self.p_high, 1.0) * (1.0 - load.d_occupancy / self.d_high)
        return spans[int(score * (len(spans) - 1) + 0.5)]


@dataclass(frozen=True)
class WorkPerRoundSpan(LoadSelectedSpan):
    """`LoadSelectedSpan`'s K, raised where a round would release little P work: to the largest
    span whose segment still holds at most `share` of a full-budget forward.

    `LoadSelectedSpan` gives K from P pressure: a deep queue passes many boundaries per round, but
    a small epoch (a short continuation prompt) has little pressure, gets the smallest K and
    waits one D iteration per boundary span, although its segments are far too small to delay D.
    A segment spanning K of the W boundaries of a whole forward (`W = max(spans)`) of an epoch of
    size `e` (in step budgets) holds about `K / W * e` of a full-budget forward; the work K is the
    largest span with `K * e <= share * W`, the whole forward when D has no rows (nothing to
    protect). This policy's K is the larger of the two, so a short epoch goes in one or two
    releases and the load rule still decides for the large ones.

    K never increases with D occupancy or the epoch's size and never decreases with P pressure.
    """

    share: float = 0.125

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_real("share", self.share)
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {self.share!r}")

    def span(self, load: Load | None = None) -> int:
        return max(super().span(load), self.work_span(load))  # super() rejects a missing Load

    def work_span(self, load: Load) -> int:
        """The largest span whose segment holds at most `share` of a full-budget forward."""
        whole = self.spans[-1]
        if load.d_occupancy == 0.0:
            return whole
        fitting = [s for s in self.spans if s * load.epoch_size <= self.share * whole]
        return fitting[-1] if fitting else self.spans[0]


def make_policy(kind: str, *, k: int = 1, spans: Sequence[int] = (1, 2, 4)) -> SegmentPolicy:
    """`kind` is "fixed" (uses `k`), "load" or "work" (use `spans`)."""
    if kind == "fixed":
        return FixedSpan(k)
    if kind == "load":
        return LoadSelectedSpan(tuple(spans))
    if kind == "work":
        return WorkPerRoundSpan(tuple(spans))
    raise ValueError(f"unknown segment policy {kind!r}; choose 'fixed', 'load' or 'work'")


def _validated_spans(spans: Sequence[int]) -> tuple[int, ...]:
    spans = tuple(spans)
    if not spans:
        raise ValueError("spans must name at least one span, got an empty sequence")
    for s in spans:
        validate_span(s, what="each span")
        if math.isinf(s):
            raise ValueError(f"each span must be finite, got {s!r}")
    if len(set(spans)) != len(spans):
        raise ValueError(f"spans must be distinct, got {spans!r}")
    return tuple(sorted(spans))


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
