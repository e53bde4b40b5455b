"""Trace file format: round trip, contexts, and errors that name the file, line and field."""

from __future__ import annotations

import pytest

from vllm_ainfer_pd.rollout.generator import generate
from vllm_ainfer_pd.rollout.trace import (
    Trace,
    TraceError,
    Trajectory,
    Turn,
    dump_trace,
    increment_ids,
    load_trace,
)


def test_dump_then_load_gives_the_same_trace(tmp_path):
    trace = generate("cpu", 0)
    dump_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


def test_contexts_accumulate_increments_and_outputs():
    t = Trajectory("a", (Turn(100, 10), Turn(5, 20, 1.0), Turn(7, 3, 0.5)))
    assert t.contexts() == [100, 115, 142]
    assert t.final_len == 145


def test_explicit_input_ids_are_sent_as_given(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "x", "turns": [{"input_ids": [5, 6, 7], "output_tokens": 2}]}\n')
    turn = load_trace(path).trajectories[0].turns[0]
    assert turn.input_tokens == 3
    assert increment_ids(turn, "any", 3, 500) == [5, 6, 7]


def test_drawn_ids_depend_only_on_key_and_range():
    turn = Turn(50, 1)
    assert increment_ids(turn, "0:t1:2", 3, 500) == increment_ids(turn, "0:t1:2", 3, 500)
    assert increment_ids(turn, "0:t1:2", 3, 500) != increment_ids(turn, "1:t1:2", 3, 500)
    assert all(3 <= i < 500 for i in increment_ids(turn, "k", 3, 500))


@pytest.mark.parametrize("line, message", [
    ('{"turns": [{"input_tokens": 3}]}', "line 1 turn 0: a turn needs output_tokens"),
    ('{"turns": [{"input_tokens": 0, "output_tokens": 1}]}', "input_tokens=0 must be an int >= 1"),
    ('{"turns": [{"input_tokens": 2, "output_tokens": 1, "wait_s": 2}]}', "first turn has wait_s"),
    ('{"turns": [{"input_tokens": 2, "input_ids": [1], "output_tokens": 1}]}',
     "input_ids has 1 ids, input_tokens=2"),
    ('{"turns": [{"input_tokens": 2, "output_tokens": 1, "sleep": 2}]}', "unknown turn field"),
    ('{"turns": []}', "has no turns"),
    ("not json", "line 1: not JSON"),
])
def test_bad_trace_lines_are_rejected_with_their_place(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_duplicate_ids_and_missing_file_are_rejected(tmp_path):
    with pytest.raises(TraceError, match="duplicate trajectory id"):
        Trace((Trajectory("a", (Turn(1, 1),)), Trajectory("a", (Turn(1, 1),))))
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")


def test_check_fits_names_the_trajectory_that_outgrows_the_server():
    trace = Trace((Trajectory("long", (Turn(2000, 100),)),))
    with pytest.raises(TraceError, match="'long' needs 2100 tokens.*max_model_len=2048"):
        trace.check_fits(2048)
