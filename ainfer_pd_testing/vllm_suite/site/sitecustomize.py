"""Imported by Python at start in every process of a vLLM suite run (this folder is first on the
run's PYTHONPATH; see `ainfer_pd_testing/vllm_suite/__init__.py`). Outside such a run it does
nothing."""

import os

if os.environ.get("AINFER_PD_VLLM_SUITE"):
    from ainfer_pd_testing.vllm_suite import hooks

    hooks.install()
