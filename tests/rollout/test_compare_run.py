"""`rollout compare` end to end on the CPU: a real stock `vllm serve` of the tiny model."""

from __future__ import annotations

import json

import pytest

from vllm_ainfer_pd.models.generate import ensure_model
from vllm_ainfer_pd.rollout.compare import CompareConfig, compare
from vllm_ainfer_pd.rollout.trace import Trace, Trajectory, Turn

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

# Later turns extend their trajectory's context: cold, only that context is a prefix-cache hit.
TRACE = Trace((
    Trajectory("a", (Turn(300, 8), Turn(200, 8, 0.1), Turn(150, 4, 0.1))),
    Trajectory("b", (Turn(400, 6), Turn(250, 6, 0.0))),
))
HITS = 'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'


def _hit_rate(run: dict) -> float:
    return run["counters"][HITS] / run["counters"]["vllm:prompt_tokens_total"]


def test_cached_replay_repeats_each_repetition_on_a_warm_prefix_cache(tmp_path):
    """Each repetition runs twice on one server: `stock` cold, then `stock_cached` with the same
    prompts, which find all but their last partial block in the prefix cache (greedy outputs
    repeat, so later turns' contexts do too), while the next cold repetition's new ids miss."""
    cfg = CompareConfig(model=str(ensure_model("tiny")), out=tmp_path, platform="cpu", reps=2,
                        wait_scale=0.5, only=("stock",), cached_replay=True, progress=False)
    rep, _ = compare(cfg, TRACE)
    assert list(rep["backends"]) == ["stock", "stock_cached"]
    cold, cached = rep["backends"]["stock"], rep["backends"]["stock_cached"]
    assert cold["error"] is None and cached["error"] is None
    assert [r["rep"] for r in cold["runs"]] == [r["rep"] for r in cached["runs"]] == [0, 1]
    for c, w in zip(cold["runs"], cached["runs"], strict=True):
        assert c["summary"]["completed"] == w["summary"]["completed"] == TRACE.num_requests
        assert c["counters"]["vllm:prompt_tokens_total"] == \
            w["counters"]["vllm:prompt_tokens_total"]
        assert _hit_rate(c) < 0.5 < 0.9 < _hit_rate(w), (_hit_rate(c), _hit_rate(w))
    assert (tmp_path / "records" / "stock_cached-1.jsonl").is_file()
    assert "stock_cached / stock" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["backends"]["stock_cached"]["runs"]

