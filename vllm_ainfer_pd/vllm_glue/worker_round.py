"""The platform worker's methods `AInferPDWorker` overrides (`worker/__init__.py`), whose split
places the lane's round around a whole D iteration.

No patch: the worker subclasses vLLM's platform worker (CPUWorker on CPU, which subclasses the V1
GPU `Worker`). The round opens in `execute_model` and, for a step with a forward, ends after
`sample_tokens` (sampling and the drafter's forward), so the names and that split are listed here.
"""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import Patch

_WORKER = "vllm.v1.worker.gpu_worker:Worker"
PATCHES = [
    Patch(f"{_WORKER}.execute_model", "the lane's round opens before D's forward (and ends here "
          "when the step has no sampling to follow)", ("self", "scheduler_output"),
          does="overrides"),
    Patch(f"{_WORKER}.sample_tokens", "the round ends after sampling and the speculative "
          "drafter's forward, the last of D's enqueues for the step", ("self", "grammar_output"),
          does="overrides"),
    Patch(f"{_WORKER}.execute_dummy_batch", "an idle DP rank's dummy forward is a round too",
          ("self",), does="overrides"),
    Patch(f"{_WORKER}.init_device", "CPU expert-parallel support and D's stream priority go in "
          "before the model is built", ("self",), does="overrides"),
    Patch(f"{_WORKER}.initialize_from_config", "the lane is built once the KV cache and the "
          "connector exist", ("self", "kv_cache_config"), does="overrides"),
    Patch(f"{_WORKER}.shutdown", "the lane's summary and close", ("self",), does="overrides"),
    Patch(_WORKER, "the lane's runner and config", uses=("model_runner", "vllm_config"),
          does="reads"),
]
