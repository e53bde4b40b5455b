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


def ttft_by_turn_kind(records: Sequence[RequestRecord], lane_min_tokens: int) -> dict[str, Any]:
    """TTFT split by what the server had to prefill, the opening burst's prefill rate, and the
    trajectory that ended last, with where its time went (`last_chain`).

    A later turn's new tokens are its prompt minus the previous turn's prompt and output (the
    prefix-cache hit when nothing was evicted); at `lane_min_tokens` or more they go through the
    P lane (`ainfer_pd.p_lane_min_tokens`), below it inline. First turns are apart because a
    trace releases them together (the opening burst). Stock and `normal` prefill everything
    inline; splitting theirs at the same threshold shows the same prompts side by side.
    `burst`: the first turns' prompt tokens over the time from the first one's submission to
    the last one's first token, the rate at which a backend gets through the opening burst.
    """
    if lane_min_tokens < 1:
        raise ValueError(f"lane_min_tokens={lane_min_tokens} must be >= 1")
    turns = {(r.trajectory, r.turn): r for r in records}
    kinds: dict[str, list[float]] = {"first turns": [], "later, lane-sized": [],
                                     "later, inline-sized": []}
    firsts: list[RequestRecord] = []
    for r in records:
        if not r.ok:
            continue
        prev = turns.get((r.trajectory, r.turn - 1))
        if r.turn == 0 or prev is None:
            kind = "first turns"
            firsts.append(r)
        elif r.prompt_tokens - prev.prompt_tokens - prev.output_tokens >= lane_min_tokens:
            kind = "later, lane-sized"
        else:
            kind = "later, inline-sized"
        kinds[kind].append(r.first_token_s - r.submit_s)
    done = [r for r in records if r.ok]
    last = max(done, key=lambda r: r.end_s, default=None)
    burst = None
    if firsts:
        tokens = sum(r.prompt_tokens for r in firsts)
        done_s = max(r.first_token_s for r in firsts) - min(r.submit_s for r in firsts)
        burst = {"prompt_tokens": tokens, "done_s": done_s,
                 "tokens_per_s": tokens / done_s if done_s > 0 else math.nan}
    return {"ttft_s": {k: {"n": len(xs), **describe(xs)} for k, xs in kinds.items()},
            "burst": burst, "last_trajectory": last.trajectory if last else None,
            "last_chain": _chain([r for r in done if last and r.trajectory == last.trajectory])}


def _chain(turns: list[RequestRecord]) -> dict[str, Any] | None:
    """Where the trajectory that ended last spent its time, which is where the makespan went once
    that trajectory started: its turns' TTFT, their decode (first to final token) and the gaps
    between one turn's end and the next one's submission (client waits). Also its longest
    decode, in tokens and seconds per token."""
    if not turns:
        return None
    turns = sorted(turns, key=lambda r: r.turn)
    longest = max(turns, key=lambda r: r.output_tokens)
    per_token = ((longest.end_s - longest.first_token_s) / (longest.output_tokens - 1)
                 if longest.output_tokens > 1 else math.nan)
    return {"start_s": turns[0].submit_s,
            "ttft_s": sum(r.first_token_s - r.submit_s for r in turns),
            "decode_s": sum(r.end_s - r.first_token_s for r in turns),
            "wait_s": sum(b.submit_s - a.end_s for a, b in zip(turns, turns[1:])),
            "longest_tokens": longest.output_tokens, "longest_s_per_token": per_token}
