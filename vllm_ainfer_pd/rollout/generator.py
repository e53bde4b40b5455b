"""Synthetic rollout traces with the paper's statistics (section 7), seeded, in several sizes.

Every size below is drawn from a log-normal fitted to a (median, p99) target, then calibrated: an
affine map in log space moves the sample's own median and p99 onto the targets, so a trace of 1,265
requests hits the paper's quantiles instead of scattering around them. The paper's prompt increments
are the continuations' (a trajectory's first prompt, its task, is much longer), so each trajectory's
initial prompt is a fourth log-normal whose two parameters are solved for so that the retained
context -- the prompt length of every request -- hits its own median and p99.

Presets: `paper` (128 trajectories, 1,265 requests, <= 10 turns, full sizes; for GPUs),
`gpu-small` (a quarter of the work at full sizes), `cpu` (16 trajectories, <= 4 turns, contexts
below 1,536 tokens and waits / 10, for the tiny model's 2,048-token window on 2 cores).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from vllm_ainfer_pd.rollout.metrics import quantile
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn

Z99 = 2.3263478740408408  # standard normal 0.99 quantile


@dataclass(frozen=True)
class Target:
    """A long-tailed distribution given by its median and 99th percentile."""

    median: float
    p99: float

    def __post_init__(self) -> None:
        if not 0 < self.median < self.p99:
            raise ValueError(f"need 0 < median < p99, got median={self.median} p99={self.p99}")

    @property
    def sigma(self) -> float:
        """Log-normal shape parameter: ln(p99 / median) = sigma * z_0.99."""
        return math.log(self.p99 / self.median) / Z99


@dataclass(frozen=True)
class TracePreset:
    name: str
    num_trajectories: int
    num_requests: int
    max_turns: int
    increment: Target  # continuation prompt increments (tokens)
    output: Target  # generated tokens per request
    context: Target  # prompt length of each request (retained context)
    wait: Target  # client wait before each continuation (s)
    max_len: int  # cap on a trajectory's final length (prompt + output of its last turn)

    def __post_init__(self) -> None:
        t, n, k = self.num_trajectories, self.num_requests, self.max_turns
        if not (t >= 1 and k >= 1 and t <= n <= t * k):
            raise ValueError(f"preset {self.name!r}: {n} requests cannot fill {t} trajectories of "
                             f"1..{k} turns")
        if self.context.p99 >= self.max_len:
            raise ValueError(f"preset {self.name!r}: context p99 {self.context.p99} must be below "
                             f"max_len {self.max_len}")


PRESETS: dict[str, TracePreset] = {
    "paper": TracePreset("paper", 128, 1265, 10, Target(292, 3062), Target(88, 1057),
                         Target(4716, 12507), Target(3.10, 15.30), max_len=32768),
    "gpu-small": TracePreset("gpu-small", 32, 316, 10, Target(292, 3062), Target(88, 1057),
                             Target(4716, 12507), Target(3.10, 15.30), max_len=32768),
    # One GPU layout's whole comparison (3 backends x 3 repetitions) within about ten minutes of
    # device time: the paper's distributions, fewer and shorter trajectories.
    "gpu-quick": TracePreset("gpu-quick", 64, 192, 4, Target(292, 3062), Target(88, 1057),
                             Target(4716, 12507), Target(3.10, 15.30), max_len=32768),
    "cpu": TracePreset("cpu", 16, 48, 4, Target(32, 320), Target(12, 128), Target(360, 1000),
                       Target(0.31, 1.53), max_len=1536),
}


def get_preset(name: str) -> TracePreset:
    if name not in PRESETS:
        raise ValueError(f"unknown trace preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def _calibrated(rng: random.Random, n: int, target: Target) -> list[float]:
    """n log-normal draws whose empirical median and p99 equal the target's: the draws' logs are
    scaled by b (bisected so the p99/median ratio matches), then the sample by a constant."""
    z = [rng.gauss(0.0, 1.0) for _ in range(n)]
    if n < 3 or len(set(z)) < 3:
        return [math.exp(math.log(target.median) + target.sigma * x) for x in z]

    def shaped(b: float) -> list[float]:
        ys = [math.exp(b * x) for x in z]
        m = quantile(ys, 0.5)
        return [y * target.median / m for y in ys]

    b = _bisect(lambda b: quantile(shaped(b), 0.99), target.p99, 0.0, 10.0)
    return shaped(b)


def _turn_counts(rng: random.Random, preset: TracePreset) -> list[int]:
    """Turns per trajectory summing to num_requests, each in 1..max_turns: all start full, and the
    deficit is taken one turn at a time from random trajectories that still have more than one."""
    counts = [preset.max_turns] * preset.num_trajectories
    for _ in range(preset.max_turns * preset.num_trajectories - preset.num_requests):
        counts[rng.choice([i for i, c in enumerate(counts) if c > 1])] -= 1
    return counts


def _bisect(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) ~= target for increasing f (clamped to the ends)."""
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _solve_initial(z0: list[float], tails: list[list[float]], target: Target) -> list[float]:
    """Initial prompts exp(mu + s * z0[t]) with (mu, s) chosen so the contexts (initial prompt +
    tails[t][k], the tokens a turn adds on top of it) have the target median and p99."""

    def contexts(mu: float, s: float) -> list[float]:
        return [math.exp(mu + s * z) + c for z, tail in zip(z0, tails, strict=True) for c in tail]

    def mu_for(s: float) -> float:
        return _bisect(lambda mu: quantile(contexts(mu, s), 0.5), target.median, -5.0, 15.0)

    s = _bisect(lambda s: quantile(contexts(mu_for(s), s), 0.99), target.p99, 0.0, 3.0)
    mu = mu_for(s)
    return [math.exp(mu + s * z) for z in z0]


def generate(preset: str | TracePreset, seed: int = 0) -> Trace:
    """A trace for `preset` (name or TracePreset); the same (preset, seed) gives the same trace."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    rng = random.Random(f"{p.name}:{seed}")
    counts = _turn_counts(rng, p)
    n_cont = p.num_requests - p.num_trajectories
    incs = [max(1, round(x)) for x in _calibrated(rng, n_cont, p.increment)]
    outs = [max(1, round(x)) for x in _calibrated(rng, p.num_requests, p.output)]
    waits = _calibrated(rng, n_cont, p.wait)
    z0 = [rng.gauss(0.0, 1.0) for _ in range(p.num_trajectories)]

    # Per trajectory: its outputs, its continuations' increments and waits, and what each turn's
    # prompt holds beyond the initial prompt.
    per_t, oi, ci = [], 0, 0
    for c in counts:
        t_out, t_inc, t_wait = outs[oi:oi + c], incs[ci:ci + c - 1], waits[ci:ci + c - 1]
        oi, ci = oi + c, ci + c - 1
        tail, total = [0.0], 0
        for k in range(1, c):
            total += t_out[k - 1] + t_inc[k - 1]
            tail.append(float(total))
        per_t.append((t_out, t_inc, t_wait, tail))
    initial = _solve_initial(z0, [t[3] for t in per_t], p.context)

    trajectories = []
    for i, ((t_out, t_inc, t_wait, _), first) in enumerate(zip(per_t, initial, strict=True)):
        in_sizes = [max(1, round(first))] + t_inc
        in_sizes, t_out = _fit(in_sizes, t_out, p.max_len)
        turns = [Turn(n_in, n_out, 0.0 if k == 0 else round(t_wait[k - 1], 4))
                 for k, (n_in, n_out) in enumerate(zip(in_sizes, t_out, strict=True))]
        trajectories.append(Trajectory(f"t{i}", tuple(turns)))
    return Trace(tuple(trajectories), {"preset": p.name, "seed": seed})


def _fit(inc: list[int], out: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """Shrink a trajectory that outgrows max_len: the initial prompt first (down to a quarter of
    itself), then every size proportionally, so its turns stay and only its tail gets shorter."""
    excess = sum(inc) + sum(out) - max_len
    if excess <= 0:
        return inc, out
    inc = [max(inc[0] // 4, inc[0] - excess)] + inc[1:]
    total = sum(inc) + sum(out)
    if total > max_len:
        f = max_len / total
        inc = [max(1, math.floor(x * f)) for x in inc]
        out = [max(1, math.floor(x * f)) for x in out]
    return inc, out
