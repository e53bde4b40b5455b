"""Model Runner V2 for the engines a process starts from here on, on the CPU.

`use_model_runner_v2()` sets the environment every engine process inherits: vLLM's runner choice
(VLLM_USE_V2_MODEL_RUNNER=1), and `mrv2_cpu/` first on PYTHONPATH with AINFER_PD_MRV2_CPU=1, whose
`sitecustomize` lets the runner's Triton kernels run in Triton's interpreter in every process
Python starts (its docstring says how). The harness's `collective_rpc` calls with functions need
VLLM_ALLOW_INSECURE_SERIALIZATION=1 as well. `tests/conftest.py` calls it for a whole pytest run
under `AINFER_PD_TEST_RUNNER=v2`; `benchmarks/mrv2_cpu_check.py` for its V2 engines.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "mrv2_cpu"


def v2_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (os.environ if None) with Model Runner V2 selected for the engines it starts."""
    environ = dict(os.environ if environ is None else environ)
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM)]
    return {**environ, "PYTHONPATH": os.pathsep.join([str(SHIM), *paths]),
            "VLLM_USE_V2_MODEL_RUNNER": "1", "AINFER_PD_MRV2_CPU": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def use_model_runner_v2() -> None:
    """Select Model Runner V2 for every engine this process starts from now on, and let this
    process build V2 configs (vLLM refuses one where Triton is off): the shim runs here too,
    which must be before anything imports vLLM's Triton utilities."""
    import runpy
    import sys

    if "vllm.triton_utils" in sys.modules:
        raise RuntimeError("Model Runner V2 must be selected before vLLM's Triton utilities "
                           "are imported in this process")
    os.environ.update(v2_env())
    runpy.run_path(str(SHIM / "sitecustomize.py"))


def expected_runner() -> str:
    """The class of vLLM's CPU model runner the engines this process starts run (`model_runner`
    of `ainfer_pd_status`): Model Runner V2's where it was selected, else the V1 runner's."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        return "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    return "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
