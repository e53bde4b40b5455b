"""The engine's scheduler, chosen by `AInferPDExecutor`.

vLLM's scheduler already serves `running` (decode rows and chunked prefills) before it admits new
prompts from `waiting`, i.e. it is D-first within a step. This subclass is where the P lane's
admission policy and the reservation of P's KV blocks live (the D-first planner issue).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class AInferPDScheduler(Scheduler):
    pass
