"""Phase-owned expert-parallel state (paper, section 5; docs/deepep.md).

Per process, the state D's expert-parallel communication uses and the state P's uses are separate
objects over the same weights and ranks, never shared:

| module | state |
|---|---|
| `manager.py` | `PhaseEP`: the phase-owned state of one worker, and its contract with the lane |
| `phase_groups.py` | vLLM's stateless all-gather/reduce-scatter: P's own EP and DP groups |
| `buffers.py` | DeepEP's `Buffer`: API checked at start; P's buffer beside D's, sizes, configs |
| `kernels.py` | DeepEP: P's fused-MoE kernel per layer (normal-mode prepare/finalize) |

`vllm_glue/moe_phase.py` routes each MoE call to the calling phase's state.
"""
