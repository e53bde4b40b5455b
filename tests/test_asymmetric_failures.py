"""A P failure on one rank only, while its peers' P goes on (an out-of-memory at one rank's batch
shape, say): the failed rank replays its forward on no-work tokens, every rank issues the same
collectives in the same order (each rank's log of them compared), the round plan ends the epoch
on every rank together, the failed jobs recompute inline with stock's tokens, the next epoch is
exact, and no KV block stays held.

TP=2 here (offline `LLM`); DP=2 + EP over `vllm serve` is in `tests/test_serve.py`.
"""

from __future__ import annotations

import pytest

from ainfer_pd_testing.collective_log import first_divergence, read_logs
from ainfer_pd_testing.parity import compare, offline_llm, parity_waves, run_waves

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 16
EXTENSION = "ainfer_pd_testing.faults.FaultsAndCollectiveLog"
# K=1: one boundary a round, so rank 1 fails at boundary 3 while rank 0 is parked at it.
LANE = {"ainfer_pd": {"p_lane_min_tokens": 32, "segment_policy": "fixed", "p_host": "concurrent",
                      "timeout_s": 60.0}}


DELAY_S = 3.0


@pytest.mark.parametrize("fail_at", ["0@1:b3", "0@1:c5"])
def test_tp2_one_rank_fails_while_the_other_goes_on(tiny_model, tmp_path, fail_at):
    """`b3`: rank 1's P fails before it publishes boundary 3 (between two segments); `c5`: before
    its sixth collective, inside a segment whose earlier collectives it already issued. Without
    the replay rank 0's P waits in an all-reduce rank 1 never issues, and the engine ends at the
    lane's timeout; with it both ranks' logs are one sequence. With `b3` the failed epoch's
    device work also completes only `DELAY_S` after its last kernel (a slow device): its jobs,
    and so their KV blocks, must stay held until then (reported at once, vLLM would hand the
    blocks to new requests while P may still write them)."""
    waves = parity_waves(vocab_size=512, seed=3)
    prompts = [p for wave in waves for p in wave]
    after = parity_waves(vocab_size=512, seed=4)
    after_prompts = [p for wave in after for p in wave]
    prefix = str(tmp_path / "collectives")
    with offline_llm(tiny_model, 2) as stock:
        stock_out, stock_after = run_waves(stock, waves, MAX_TOKENS), run_waves(stock, after,
                                                                               MAX_TOKENS)
        with offline_llm(tiny_model, 2, backend="ainfer_pd", additional_config=LANE,
                         worker_extension_cls=EXTENSION) as ours:
            llm = ours.llm
            delay = f"0:{DELAY_S}" if fail_at.endswith("b3") else ""
            assert llm.collective_rpc("inject_p_faults", kwargs={
                "fail_at": fail_at, "device_delay": delay}) == [{"rank": 0}, {"rank": 1}]
            llm.collective_rpc("start_collective_log", args=(prefix,))
            ours_out = run_waves(ours, waves, MAX_TOKENS)
            failed = [s["p_lane"] for s in ours.worker_status()]
            ours_after = run_waves(ours, after, MAX_TOKENS)
            lanes = [s["p_lane"] for s in ours.worker_status()]
            all_freed = llm.reset_prefix_cache()
        report = compare(prompts, stock_out, ours_out, stock.teacher_force)
        report_after = compare(after_prompts, stock_after, ours_after, stock.teacher_force)
    print(fail_at, report, report_after, failed)
    assert report.fail == 0 and report_after.fail == 0, (report, report_after)
    # Epoch 0's jobs failed on both TP ranks (they share its KV), and later epochs completed.
    assert failed[0]["jobs_failed"] == failed[1]["jobs_failed"] > 0, failed
    if fail_at.endswith("b3"):
        # The failed jobs were held until the late device work was done: the delay runs from
        # P's last kernel, a little before the epoch closed, and reported at once they would
        # show ~0 s.
        assert all(DELAY_S - 0.5 < f["p_drain_s"] < DELAY_S + 5 for f in failed), failed
    assert lanes[0]["epochs"] == lanes[1]["epochs"] > failed[0]["epochs"], lanes
    assert lanes[0]["jobs_done"] > failed[0]["jobs_done"] and lanes[0]["inflight"] == 0, lanes
    assert all_freed  # no request, and so no P reservation, holds a KV block
    logs = read_logs(prefix, 2)
    assert any(e.startswith("P ") for e in logs[0]), logs[0][:20]
    assert len(logs[0]) == len(logs[1]) and first_divergence(logs) is None, \
        first_divergence(logs)
