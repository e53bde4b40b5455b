"""Imported by Python at start in every process of a vLLM suite run (this folder is first on the
run's PYTHONPATH; see `ainfer_pd_testing/vllm_suite/__init__.py`). Outside such a run it does
nothing. Python imports one `sitecustomize`, so this one also runs Model Runner V2's CPU shim
where a run selected it (`ainfer_pd_testing/model_runner_v2.py`), which it would otherwise hide."""

import os

if os.environ.get("AINFER_PD_MRV2_CPU") == "1":
    import runpy

    from ainfer_pd_testing.model_runner_v2 import SHIM

    runpy.run_path(str(SHIM / "sitecustomize.py"))

if os.environ.get("AINFER_PD_VLLM_SUITE"):
    from ainfer_pd_testing.vllm_suite import hooks

    hooks.install()
