"""Phase-owned expert-parallel state (paper, section 5; docs/deepep.md).

Per process, the state D's expert-parallel communication uses and the state P's uses are separate
objects over the same weights and ranks, never shared:

| module | state |
|---|---|
| `manager.py` | `PhaseEP`: the phase-owned state of one worker, and its contract with the lane |
| `phase_groups.py` | vLLM's stateless all-gather/reduce-scatter: P's own EP and DP groups |
| `buffers.py` | DeepEP's 1.x `Buffer` (vLLM 0.26's pin): its API checked at start; P's normal-mode buffer beside D's low-latency one, their sizes, P's own configs |
| `kernels.py` | DeepEP: P's fused-MoE kernel per layer (normal-mode prepare/finalize) |

`vllm_glue/moe_phase.py` routes each MoE call to the calling phase's state.
"""
