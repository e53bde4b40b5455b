"""The parity rule itself: exact, tie and fail, on hand-made logprobs (no engine)."""

from __future__ import annotations

from ainfer_pd_testing.parity import TIE_EPSILON, compare, parity_waves

PROMPT = [7, 8, 9]


def _forced(best_by_pos: dict[int, dict[int, float]]):
    """A teacher-forcing function returning the given {position: {token: logprob}}."""

    def teacher_force(seqs):
        return [[best_by_pos.get(pos) for pos in range(len(s))] for s in seqs]

    return teacher_force


def test_identical_outputs_are_exact_without_teacher_forcing():
    def never(seqs):
        raise AssertionError("teacher forcing must not run for identical outputs")

    report = compare([PROMPT], [[1, 2, 3]], [[1, 2, 3]], never)
    assert (report.exact, report.tie, report.fail) == (1, 0, 0)


def test_divergence_at_a_near_tie_is_a_tie():
    # stock chose 2 at output 1 (position 4); ours chose 5, which stock scores within epsilon.
    logprobs = {4: {2: -1.0, 5: -1.0 - TIE_EPSILON / 2}, 5: {6: -0.5}}
    report = compare([PROMPT], [[1, 2, 3]], [[1, 5, 6]], _forced(logprobs))
    assert (report.exact, report.tie, report.fail) == (0, 1, 0), report


def test_divergence_beyond_epsilon_fails():
    logprobs = {4: {2: -1.0, 5: -1.5}, 5: {6: -0.5}}
    report = compare([PROMPT, PROMPT], [[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 5, 6]],
                     _forced(logprobs))
    assert report.fail == 1 and "gap" in report.details[0]
    assert report.failed == [1]  # which prompt, for diagnosis (parity.stock_alone)


def test_tie_followed_by_a_non_greedy_token_fails():
    # the tie itself is fine, but after it our sequence must still be stock's greedy choice
    logprobs = {4: {2: -1.0, 5: -1.0}, 5: {6: -0.5, 9: -2.0}}
    report = compare([PROMPT], [[1, 2, 3]], [[1, 5, 9]], _forced(logprobs))
    assert report.fail == 1 and "output 2" in report.details[0]


def test_length_mismatch_fails():
    report = compare([PROMPT], [[1, 2, 3]], [[1, 2]], _forced({}))
    assert report.fail == 1 and report.failed == [0]


def test_waves_are_deterministic_and_extend_previous_turns():
    waves = parity_waves(512)
    assert waves == parity_waves(512)
    assert len(waves) == 3
    for prev, cur in zip(waves[-2], waves[-1]):
        assert cur[: len(prev)] == prev and len(cur) > len(prev)
    assert all(3 <= t < 512 for wave in waves for p in wave for t in p)
