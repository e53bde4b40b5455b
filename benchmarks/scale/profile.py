"""Cost profiles: measured step times of one engine on one device, and the constants fitted to them.

A profile is one JSON file (`benchmarks/results/scale/profile_*.json`), written by
`benchmarks/profile_costs.py` (which drives a real vLLM engine through `LLM(...)`) or derived from
the measured rollouts by hand (its `source` says which). It holds:

- `shape`: the model (`shape.ModelShape`);
- `hardware`: `peak_tflops`, `hbm_tbps` (for the record and for scaling), the expert-parallel
  collectives' `collective_latency_us` (fixed per collective), `link_gbps` and `hop_latency_us`
  within a node, `inter_node_gbps` and `inter_node_hop_us` across nodes, `gpus_per_node`, `cores`
  (CPU profiles);
- `engine`: `max_num_batched_tokens`, `max_num_seqs`, `block_size`, `async_scheduling`,
  `client_overhead_s` and `client_overhead_per_token_s` (the server's handling of a request
  before its engine sees it, per request and per prompt token), `normal_step_overhead`
  (the backend's per-step cost with no P, a fraction);
- `points`: measured forwards, each `{"rows", "context", "chunks": [[new, start], ...],
  "seconds", "source"}` (decode rows, the sum of their contexts, prefill chunks);
- `lane`: the P lane as measured beside D: `overlap` (P device time D overlapped, from
  `p_overlap_s / p_device_s`), `p_host_per_interval_s` and `p_host_per_segment_s` (P's host time
  per boundary interval and per released segment), `d_host_slack_s` (D's own host time per
  round in which P's host work is free), `rendezvous_s` by rank count, `handoff` (the CPU's
  `p_host`), and the lane's defaults;
- `fit` (optional): constants fixed by hand instead of fitted (a derived profile of a larger model
  keeps the measured device's efficiencies).

`fit_costs` fits `seconds = t0 + bytes * s_per_byte + flops * s_per_flop` over the points
(non-negative least squares: three global constants per device, not one per run).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.scale.shape import Batch, ModelShape, Work, batch_work
from vllm_ainfer_pd.config import AInferPDConfig

_PRODUCT = AInferPDConfig()

ENGINE_DEFAULTS: dict[str, Any] = {
    "max_num_batched_tokens": 8192, "max_num_seqs": 1024, "block_size": 16,
    "async_scheduling": True, "client_overhead_s": 0.002, "client_overhead_per_token_s": 0.0,
    "normal_step_overhead": 0.003, "cudagraph_capture_size": 512, "h_eager_s": None,
}
LANE_DEFAULTS: dict[str, Any] = {
    "overlap": 0.0, "contention": 0.0, "async_hide": 0.0, "p_host_per_interval_s": 0.0,
    "p_host_per_segment_s": 0.0, "d_host_slack_s": 0.0, "handoff": False,
    "rendezvous_s": {"1": 0.0, "2": 1.0e-5, "4": 1.3e-5, "8": 3.1e-5, "16": 6.0e-4},
    # The product's own defaults (config.py): the lane's threshold (unset: by layout, config's
    # `lane_min_tokens`), prompts in flight, the segment policy, the ordering, the epoch gate
    # (DP > 1 only; fill 0 = off).
    **{name: getattr(_PRODUCT, name) for name in (
        "p_lane_min_tokens", "max_p_inflight", "segment_policy", "segment_span", "ordering",
        "epoch_gate_fill", "epoch_gate_rounds")},
}
HARDWARE_DEFAULTS: dict[str, Any] = {
    "name": "", "peak_tflops": 0.0, "hbm_tbps": 0.0, "link_gbps": 360.0, "hop_latency_us": 2.0,
    "collective_latency_us": 10.0, "inter_node_gbps": 40.0, "inter_node_hop_us": 10.0,
    "gpus_per_node": 8, "cores": 0,
}


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Point:
    batch: Batch
    seconds: float
    source: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Point:
        chunks = tuple((int(n), int(s)) for n, s in raw.get("chunks", ()))
        samples = int(raw.get("samples", len(chunks)))
        return cls(Batch(raw.get("rows", 0), raw.get("context", 0), chunks, samples),
                   float(raw["seconds"]), str(raw.get("source", "")))

    def to_dict(self) -> dict[str, Any]:
        b = self.batch
        return {"rows": b.rows, "context": b.context, "chunks": [list(c) for c in b.chunks],
                "samples": b.samples, "seconds": self.seconds, "source": self.source}


FULL, PIECEWISE, EAGER = "full", "piecewise", "eager"


def graph_mode(batch: Batch, capture: int) -> str:
    """How vLLM runs a forward of this batch (CUDAGraphMode.FULL_AND_PIECEWISE, the default on
    GPU): a decode-only batch of at most `capture` tokens replays a full CUDA graph, a mixed one
    the piecewise graphs (attention in between), anything larger runs the compiled model without
    graphs, its kernels launched from Python. `capture` 0: no graphs (the CPU)."""
    if capture <= 0 or batch.tokens > capture:
        return EAGER
    # A 1-token prompt chunk (a lane job's last token after its promotion) has a decode's shape:
    # vLLM still replays the full graph for a batch of single-token queries.
    return PIECEWISE if any(n > 1 for n, _ in batch.chunks) else FULL


@dataclass(frozen=True)
class Costs:
    """Fitted per-forward constants. Device time: `t0 + bytes * s_per_byte + flops *
    s_per_flop + attn_flops * s_per_attn_flop`; a forward lasts at least its graph mode's host
    time (`h_piecewise`, `h_eager`: the host launching a forward's kernels one by one, whatever
    its size)."""

    t0: float
    s_per_byte: float
    s_per_flop: float
    s_per_attn_flop: float = 0.0
    h_piecewise: float = 0.0
    h_eager: float = 0.0

    @property
    def eff_tbps(self) -> float:
        return 1e-12 / self.s_per_byte if self.s_per_byte else float("inf")

    @property
    def eff_tflops(self) -> float:
        return 1e-12 / self.s_per_flop if self.s_per_flop else float("inf")

    def device(self, work: Work, with_t0: bool = True) -> float:
        return ((self.t0 if with_t0 else 0.0) + work.bytes * self.s_per_byte
                + work.flops * self.s_per_flop + work.attn_flops * self.s_per_attn_flop)

    def forward(self, work: Work, mode: str) -> float:
        floor = {PIECEWISE: self.h_piecewise, EAGER: self.h_eager}.get(mode, 0.0)
        return max(floor, self.device(work))

    def to_dict(self) -> dict[str, float]:
        return {"t0": self.t0, "s_per_byte": self.s_per_byte, "s_per_flop": self.s_per_flop,
                "s_per_attn_flop": self.s_per_attn_flop,
                "h_piecewise": self.h_piecewise, "h_eager": self.h_eager,
                "eff_tbps": self.eff_tbps, "eff_tflops": self.eff_tflops}


@dataclass(frozen=True)
class Profile:
    name: str
    shape: ModelShape
    source: str
    hardware: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    lane: dict[str, Any] = field(default_factory=dict)
    points: tuple[Point, ...] = ()
    fixed_costs: Costs | None = None
    path: str = ""

    def __post_init__(self) -> None:
        for name, defaults in (("hardware", HARDWARE_DEFAULTS), ("engine", ENGINE_DEFAULTS),
                               ("lane", LANE_DEFAULTS)):
            merged = {**defaults, **getattr(self, name)}
            unknown = sorted(set(merged) - set(defaults))
            if unknown:
                raise ProfileError(f"profile {self.name!r}: unknown {name} key(s) "
                                   f"{', '.join(unknown)}")
            object.__setattr__(self, name, merged)
        if self.fixed_costs is None and len(self.points) < 3:
            raise ProfileError(f"profile {self.name!r} needs at least 3 points to fit its costs "
                               f"(has {len(self.points)}) or a fixed 'fit'")

    @property
    def capture(self) -> int:
        return int(self.engine["cudagraph_capture_size"])

    @property
    def costs(self) -> Costs:
        if self.fixed_costs is not None:
            return self.fixed_costs
        cached = self.__dict__.get("_costs")
        if cached is None:
            h = self.engine["h_eager_s"]
            cached = fit_costs(self.shape, self.points, self.capture,
                               h_eager=None if h is None else float(h))
            object.__setattr__(self, "_costs", cached)
        return cached

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "") -> Profile:
        try:
            fixed = raw.get("fit")
            return cls(name=str(raw["name"]), shape=ModelShape.from_dict(raw["shape"]),
                       source=str(raw.get("source", "")), hardware=dict(raw.get("hardware", {})),
                       engine=dict(raw.get("engine", {})), lane=dict(raw.get("lane", {})),
                       points=tuple(Point.from_dict(p) for p in raw.get("points", ())),
                       fixed_costs=Costs(**{k: float(v) for k, v in fixed.items()})
                       if fixed else None,
                       path=path)
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{path or 'profile'}: malformed ({e!r})") from None

    def to_dict(self, with_fit: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source,
                               "shape": self.shape.to_dict(), "hardware": self.hardware,
                               "engine": self.engine, "lane": self.lane,
                               "points": [p.to_dict() for p in self.points]}
        if self.fixed_costs is not None:
            out["fit"] = {k: v for k, v in self.fixed_costs.to_dict().items()
                          if not k.startswith("eff_")}
        if with_fit:
            out["fitted"] = self.costs.to_dict()
            out["fitted"]["residuals"] = residuals(self)
        return out


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON ({e.msg})") from None
    return Profile.from_dict(raw, str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")


def fit_costs(shape: ModelShape, points: tuple[Point, ...], capture: int = 0,
              s_per_byte: float | None = None, h_eager: float | None = None) -> Costs:
    """The host floors, then the device constants.

    Floors (GPU, `capture` > 0): `h_piecewise` is the median of the mixed batches' times within
    the capture size; `h_eager` (unless given) the median of the batches above it of at most
    2,048 tokens, whose device work is far below what they take. Device: non-negative least
    squares of seconds on (1, bytes, FLOPs) over the decode-only points and the points whose
    time is well above their mode's floor, in relative error (a 2 ms decode step weighs as much
    as a 70 ms prefill). `s_per_byte` given: the device's memory rate is held (measured on
    another model) and the rest fitted."""
    modes = [graph_mode(p.batch, capture) for p in points]
    h_piece = 0.0
    if capture > 0:
        piece = [p.seconds for p, m in zip(points, modes, strict=True) if m == PIECEWISE]
        h_piece = statistics.median(piece) if piece else 0.0
        if h_eager is None:
            light = [p.seconds for p, m in zip(points, modes, strict=True)
                     if m == EAGER and p.batch.tokens <= 2048]
            h_eager = statistics.median(light) if light else 0.0
    h_eager = h_eager or 0.0
    floor = {FULL: 0.0, PIECEWISE: h_piece, EAGER: h_eager if capture > 0 else 0.0}
    device_points = [p for p, m in zip(points, modes, strict=True)
                     if p.seconds >= 1.25 * floor[m]]
    held = 0.0 if s_per_byte is None else s_per_byte
    # Prefill attention at the linear layers' rate: a fourth constant fitted to the points came
    # out beyond the device's peak for the linear layers (the MLA profile), so the points do not
    # separate the two.
    cols = (0, 2) if s_per_byte is not None else (0, 1, 2)
    rows = []  # (features, target seconds, measured seconds)
    for p in device_points:
        w = batch_work(shape, p.batch, p.batch.tokens)
        rows.append(((1.0, w.bytes, w.flops + w.attn_flops, 0.0), p.seconds - w.bytes * held,
                     p.seconds))
    best: tuple[float, tuple[float, ...]] | None = None
    # At most three unknowns: try every subset of the free columns, keep the best non-negative
    # solution (an unknown left out is zero).
    for free in itertools.chain.from_iterable(itertools.combinations(cols, k)
                                              for k in range(len(cols), 0, -1)):
        coef = _lstsq([[r[0][j] / r[2] for j in free] for r in rows], [r[1] / r[2] for r in rows])
        if coef is None or any(c < 0 for c in coef):
            continue
        full = [0.0, held, 0.0, 0.0]
        for j, c in zip(free, coef, strict=True):
            full[j] = c
        err = sum((sum(f * x for f, x in zip(full, r[0], strict=True)) / r[2] - 1.0) ** 2
                  for r in rows)
        if best is None or err < best[0] - 1e-12:
            best = (err, tuple(full))
    if best is None:
        raise ProfileError("no non-negative cost fit")
    t0, sb, sf, _ = best[1]
    return Costs(t0, sb, sf, sf, h_piecewise=h_piece, h_eager=h_eager if capture > 0 else 0.0)


def fit_routing(shape: ModelShape, points: tuple[Point, ...], s_per_byte: float,
                capture: int = 0, h_eager: float | None = None) -> tuple[ModelShape, Costs]:
    """The shape with the `routing_experts` (a power of two from top_k up to all experts) whose
    cost fit, at the device's memory rate `s_per_byte`, has the least squared relative error: how
    many experts the measured steps' routing actually spread over."""
    from dataclasses import replace

    best: tuple[float, ModelShape, Costs] | None = None
    e = shape.top_k
    candidates = []
    while e < shape.experts:
        candidates.append(e)
        e *= 2
    for e in [*candidates, shape.experts]:
        cand = replace(shape, routing_experts=0 if e == shape.experts else e)
        c = fit_costs(cand, points, capture, s_per_byte, h_eager)
        err = sum((_predict(cand, c, p, capture) / p.seconds - 1.0) ** 2 for p in points)
        if best is None or err < best[0] - 1e-9:
            best = (err, cand, c)
    assert best is not None
    return best[1], best[2]


def _predict(shape: ModelShape, c: Costs, p: Point, capture: int) -> float:
    return c.forward(batch_work(shape, p.batch, p.batch.tokens), graph_mode(p.batch, capture))


def residuals(profile: Profile) -> list[float]:
    """Predicted / measured - 1 of every point."""
    c = profile.costs
    return [round(_predict(profile.shape, c, p, profile.capture) / p.seconds - 1.0, 4)
            for p in profile.points]


def _lstsq(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Normal equations with scaled columns (bytes and FLOPs differ by many orders)."""
    n = len(a[0])
    scale = [max(abs(r[j]) for r in a) or 1.0 for j in range(n)]
    a = [[r[j] / scale[j] for j in range(n)] for r in a]
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] for i in range(n)]
    v = [sum(r[i] * y for r, y in zip(a, b, strict=True)) for i in range(n)]
    # Gaussian elimination with partial pivoting.
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        v[col], v[piv] = v[piv], v[col]
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            for j in range(col, n):
                m[i][j] -= f * m[col][j]
            v[i] -= f * v[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (v[i] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return [x[j] / scale[j] for j in range(n)]
