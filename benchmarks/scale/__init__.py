"""The scale model (docs/scale-model.md): a discrete-event model of a rollout on N DP ranks with
expert parallelism, for stock vLLM, stock with prefill cadence, `normal` and `pd`, calibrated by
cost profiles and validated against the measured rollouts before it projects past them.

Module map: shape.py (a MoE's bytes and FLOPs per forward), profile.py (cost profiles and their
fit), costs.py (forwards, collectives and lockstep), engines.py (what each engine schedules per
rank), sim.py (the event loop: client, router, ranks, the lane's rounds), validate.py (every
measured run, as listed in `benchmarks/results/scale/runs.json`), project.py (DP = 1..16),
__main__.py (`python -m benchmarks.scale ...`, from the checkout's root). Not part of the
installed package: it reads the measured runs and profiles in `benchmarks/results/`.
"""

from __future__ import annotations

from benchmarks.scale.costs import CostModel, Layout
from benchmarks.scale.engines import ENGINES, EngineSpec
from benchmarks.scale.profile import Profile, load_profile
from benchmarks.scale.sim import SimResult, simulate

__all__ = ["ENGINES", "CostModel", "EngineSpec", "Layout", "Profile", "SimResult",
           "load_profile", "simulate"]
