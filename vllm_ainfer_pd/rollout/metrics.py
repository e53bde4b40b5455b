"""Rollout metrics from per-request records (the paper's section 7 definitions).

- makespan: first release -> last final token of the whole trace (the primary metric);
- completed requests/s: completed requests / makespan;
- request completion: submission -> final token, per request;
- trajectory completion: first release -> last turn's final token, including client waits;
- TTFT: submission -> first generated token; TPOT: (final - first token) / (output tokens - 1).

Times are seconds from the replay's start. Failed requests count in `failed` and are left out of
every latency; a trajectory with a failed turn is left out of trajectory completion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ainfer_pd.rollout.replayer import RequestRecord


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default); NaN for an empty sample."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile q={q} must be in [0, 1]")
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(xs: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean of a sample (NaN when empty)."""
    return {"p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99),
            "mean": sum(xs) / len(xs) if xs else math.nan}


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Every metric above for one replay. `records` holds one record per trace request."""
    done = [r for r in records if r.ok]
    by_traj: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_traj.setdefault(r.trajectory, []).append(r)
    traj_times = [max(r.end_s for r in rs) - min(r.release_s for r in rs)
                  for rs in by_traj.values() if all(r.ok for r in rs)]
    first_release = min((r.release_s for r in records if not math.isnan(r.release_s)), default=0.0)
    makespan = max((r.end_s for r in done), default=math.nan) - first_release
    tpot = [(r.end_s - r.first_token_s) / (r.output_tokens - 1) for r in done
            if r.output_tokens > 1]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "trajectories": len(by_traj),
        "makespan_s": makespan,
        "requests_per_s": len(done) / makespan if done and makespan > 0 else math.nan,
        "request_completion_s": describe([r.end_s - r.submit_s for r in done]),
        "trajectory_completion_s": describe(traj_times),
        "ttft_s": describe([r.first_token_s - r.submit_s for r in done]),
        "tpot_s": describe(tpot),
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
    }
