"""The generator reproduces the paper's trace statistics (section 7) and the presets' limits."""

from __future__ import annotations

import pytest

from vllm_ainfer_pd.rollout.generator import PRESETS, Target, TracePreset, generate
from vllm_ainfer_pd.rollout.metrics import quantile

# Paper, section 7: medians and p99s of the main-campaign trace.
PAPER = {"increment": (292, 3062), "output": (88, 1057), "context": (4716, 12507),
         "wait": (3.10, 15.30)}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_paper_preset_hits_trace_quantiles(seed):
    trace = generate("paper", seed)
    stats = trace.stats()
    for name, (median, p99) in PAPER.items():
        assert quantile(stats[name], 0.5) == pytest.approx(median, rel=0.02), name
        assert quantile(stats[name], 0.99) == pytest.approx(p99, rel=0.02), name


def test_paper_preset_has_paper_shape():
    trace = generate("paper", 0)
    turns = [len(t.turns) for t in trace.trajectories]
    assert len(trace.trajectories) == 128
    assert trace.num_requests == 1265
    assert max(turns) == 10 and min(turns) >= 1
    assert len(trace.stats()["increment"]) == 1137  # continuations released after a generation
    # Long-tailed: the mean sits well above the median (a log-normal with sigma ~1).
    outputs = trace.stats()["output"]
    assert sum(outputs) / len(outputs) > 1.4 * quantile(outputs, 0.5)
    # Whole-trace token totals near the paper's 6.57M input / 0.22M output tokens.
    stats = trace.stats()
    assert sum(stats["context"]) == pytest.approx(6_574_104, rel=0.1)
    assert sum(stats["output"]) == pytest.approx(220_862, rel=0.2)


def test_same_seed_same_trace_other_seed_other_trace():
    assert generate("cpu", 3) == generate("cpu", 3)
    assert generate("cpu", 3) != generate("cpu", 4)


@pytest.mark.parametrize("seed", range(5))
def test_cpu_preset_fits_the_tiny_model(seed):
    trace = generate("cpu", seed)
    assert len(trace.trajectories) == 16
    assert max(len(t.turns) for t in trace.trajectories) <= 4
    assert trace.max_len <= PRESETS["cpu"].max_len < 2048
    for t in trace.trajectories:
        assert t.turns[0].wait_s == 0
        assert all(turn.wait_s < 5 for turn in t.turns)


def test_invalid_targets_and_presets_name_the_bad_value():
    with pytest.raises(ValueError, match="median=10 p99=5"):
        Target(10, 5)
    with pytest.raises(ValueError, match="20 requests cannot fill 4 trajectories"):
        TracePreset("bad", 4, 20, 3, Target(1, 2), Target(1, 2), Target(1, 2), Target(1, 2), 99)
    with pytest.raises(ValueError, match="unknown trace preset 'huge'"):
        generate("huge")
