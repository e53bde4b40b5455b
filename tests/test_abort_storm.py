"""The P-lane abort storm (ainfer_pd_testing/abort_storm.py): 200 requests aborted while their
background prefill is in flight (plus aborts mid-decode and right after the P report), in a pool of
multi-turn chats; no leaked KV block, no stuck request, no stale token vs stock vLLM, and the engine
still serves afterwards. The 1000-abort run is the CLI,
`python -m ainfer_pd_testing.abort_storm --aborts 1000` (benchmarks/results/cpu/).
"""

from __future__ import annotations

import pytest

from ainfer_pd_testing.abort_storm import run_storm

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

ABORTS = 200


def test_abort_storm_in_p(tiny_model):
    report = run_storm(tiny_model, aborts=ABORTS, seed=0)
    print(report.summary())
    assert report.ok, report.summary()
    assert report.aborts_in_p >= ABORTS, report.summary()
    assert report.aborts_in_d > 0, report.summary()
    assert report.finished > 0 and report.parity_fail == 0, report.summary()
    assert report.parity_exact + report.parity_tie == report.parity_prompts == report.finished
    assert report.free_blocks_after == report.free_blocks_before, report.summary()
    assert report.final_request in ("exact", "tie"), report.summary()
    assert report.lane["jobs_done"] > 0 and report.lane["jobs_cancelled"] > 0, report.lane


def test_abort_storm_with_prompts_prefilled_in_parts(tiny_model):
    """A 128-token step budget: the lane prefills most prompts in parts over several epochs, so
    aborts land between parts too (a part's blocks stay held until it drained)."""
    report = run_storm(tiny_model, aborts=100, seed=1, max_num_batched_tokens=128)
    print(report.summary())
    assert report.ok, report.summary()
    assert report.aborts_in_p >= 100 and report.parity_fail == 0, report.summary()
    assert report.free_blocks_after == report.free_blocks_before, report.summary()
    # More epochs than jobs: prompts were split (each epoch holds at most 128 P tokens).
    assert report.lane["epochs"] >= report.lane["p_tokens"] / 128 > report.lane["jobs_done"]
