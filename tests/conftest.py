"""Fixtures shared by the whole suite: the generated tiny models (cached across runs).

`AINFER_PD_TEST_RUNNER=v2` runs every engine the tests start on vLLM's Model Runner V2
(`ainfer_pd_testing.model_runner_v2`; vLLM 0.32 on); unset, vLLM picks the runner, which on the
CPU without a Triton CPU backend is the V1 runner.
"""

from __future__ import annotations

import os

import pytest

# Imported for its side effect: this checkout on PYTHONPATH, so that the processes tests start
# (`vllm serve`, scripts, vLLM's workers) can import the harness's worker extensions.
import ainfer_pd_testing  # noqa: F401
from vllm_ainfer_pd.models import ensure_model

# How `make test` shares the 2 cores (two pytest-xdist workers, then one):
# - EXCLUSIVE tests (marker `exclusive`) need the machine to themselves: waits, timeouts and skew
#   that a concurrent engine would stretch. They run last, one at a time.
# - MULTI_RANK tests start engines of 2 ranks or more: one unit of work, so one at a time on one
#   worker, beside the other worker's single-rank modules; first, as it is the longest.
# - Every other module is a unit of its own, so a module's shared engines stay shared.
EXCLUSIVE = (
    "tests/test_hang_safety.py",  # P held past the lane's timeout; a stalled TP=2 rank
    "tests/test_phase_groups.py",  # two gloo ranks, a peer gone within a timeout
    "tests/turnstile/",  # ranks as processes, skew, timeouts and watchdogs
)
MULTI_RANK = (
    "tests/test_phase_ep.py",  # DP=2 + EP servers
    "tests/test_serve.py",  # DP=2 + EP servers, two hosts
    "tests/test_rl_frameworks.py",  # DP=2 + EP pause servers
    "tests/test_asymmetric_failures.py",  # TP=2
    "tests/test_parity_offline.py::test_offline_tp2_drafting_stays_inside_the_round",
)


def pytest_configure(config: pytest.Config) -> None:
    runner = os.environ.get("AINFER_PD_TEST_RUNNER", "")
    if runner not in ("", "v1", "v2"):
        raise pytest.UsageError(f"AINFER_PD_TEST_RUNNER={runner!r}: use v1 or v2")
    if runner == "v2":
        from ainfer_pd_testing.model_runner_v2 import use_model_runner_v2

        use_model_runner_v2()


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.nodeid.startswith(EXCLUSIVE):  # before `-m` deselects by marker
        item.add_marker(pytest.mark.exclusive)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(MULTI_RANK))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndMultiRank(LoadScopeScheduling):
        """A unit of work per module, except that the multi-rank tests are one unit together."""

        def _split_scope(self, nodeid: str) -> str:
            return "multi-rank" if nodeid.startswith(MULTI_RANK) else nodeid.split("::")[0]

    config.option.loadscopereorder = False  # units in collection order: multi-rank first
    return ModulesAndMultiRank(config, log)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(ensure_model("tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_model_other_seed() -> str:
    """Same shape, different random weights: a model whose tokens must NOT pass the parity bar."""
    return str(ensure_model("tiny", seed=1))
