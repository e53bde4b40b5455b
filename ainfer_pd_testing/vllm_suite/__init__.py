"""vLLM's own test suite run against the backend: a differential run of vLLM 0.26.0's `tests/`,
stock against `ainfer_pd` (`benchmarks/vllm_tests.py`, `make vllm-tests`).

The overlay reaches every engine vLLM's tests build, in every process (the pytest process, `vllm
serve` subprocesses, spawned engine cores), without editing a line of vLLM's tests:

- `site/sitecustomize.py` is first on PYTHONPATH of the run; when `AINFER_PD_VLLM_SUITE` is set,
  Python imports it at start in each process, and it installs `hooks`.
- `hooks` patches `EngineArgs.__post_init__` after vLLM imports it: `VllmRunner`, `LLM(...)`,
  `AsyncEngineArgs` and `vllm serve` all build their engine through it. Both runs get the same CPU
  settings; the `ours` run also gets `ainfer_pd` as executor backend and a low
  `p_lane_min_tokens`, so the P lane takes the tests' short prompts.
- `hub` maps the hub model names the chosen tests load to the project's embedded tiny model, as
  an offline Hugging Face cache (the same mapping in both runs).
- `pytest_plugin` records each test's outcome and how many P-lane jobs it ran.

Environment of a run (set by `benchmarks/vllm_tests.py`):
- `AINFER_PD_VLLM_SUITE`: `stock` or `ours`;
- `AINFER_PD_VLLM_SUITE_LOG`: a folder where each process appends what it did (engines built,
  P-lane jobs), read by the pytest plugin;
- `AINFER_PD_VLLM_SUITE_BREAK=drop-token`: the negative control, a deliberately broken lane that
  prefills each prompt with its first token dropped (harness only, never the product).
"""

from __future__ import annotations

from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
MODE_ENV = "AINFER_PD_VLLM_SUITE"
LOG_ENV = "AINFER_PD_VLLM_SUITE_LOG"
BREAK_ENV = "AINFER_PD_VLLM_SUITE_BREAK"
MODES = ("stock", "ours")
BREAKS = ("drop-token",)
