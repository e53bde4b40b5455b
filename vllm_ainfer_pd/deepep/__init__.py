"""Phase-owned expert-parallel state (paper, section 5; docs/deepep.md).

Per process, the state D's expert-parallel communication uses and the state P's uses are separate
objects over the same weights and ranks, never shared:

| module | state |
|---|---|
| `phase_groups.py` | vLLM's stateless all-gather/reduce-scatter backend: P's own EP and DP communicators |

`vllm_glue/moe_phase.py` routes each MoE call to the calling phase's state.
"""
