"""The scale model (docs/scale-model.md): a discrete-event model of a rollout on N DP ranks with
expert parallelism, for stock vLLM, stock with prefill cadence, `normal` and `pd`, calibrated by
cost profiles and validated against the measured rollouts before it projects past them.

Module map: shape.py (a MoE's bytes and FLOPs per forward), profile.py (cost profiles and their
fit), costs.py (forwards, collectives and lockstep), engines.py (what each engine schedules per
rank), sim.py (the event loop: client, router, ranks, the lane's rounds), validate.py (every
measured run), project.py (DP = 1..16), cli.py (`vllm-ainfer-pd-rollout project ...`).
"""

from __future__ import annotations

from vllm_ainfer_pd.rollout.scale.costs import CostModel, Layout
from vllm_ainfer_pd.rollout.scale.engines import ENGINES, EngineSpec
from vllm_ainfer_pd.rollout.scale.profile import Profile, load_profile
from vllm_ainfer_pd.rollout.scale.sim import SimResult, simulate

__all__ = ["ENGINES", "CostModel", "EngineSpec", "Layout", "Profile", "SimResult",
           "load_profile", "simulate"]
