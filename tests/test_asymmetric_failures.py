"""A P failure on one rank only, while its peers' P goes on (an out-of-memory at one rank's batch
shape, say): the failed rank replays its forward on no-work tokens, every rank issues the same
collectives in the same order (each rank's log of them compared), the round plan ends the epoch
on every rank together, the failed jobs recompute inline with `mode=normal`'s and stock's tokens
(the tie rule), the next epoch is right, and no KV block stays held.

TP=2 here (offline `LLM`); DP=2 + EP over `vllm serve` is in `tests/test_serve.py`.
"""

from __future__ import annotations

import pytest

from ainfer_pd_testing.collective_log import first_divergence, read_logs
from ainfer_pd_testing.faults import WITH_LOG
from ainfer_pd_testing.parity import compare, offline_llm, parity_waves, run_waves

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 16
# K=1: one boundary a round, so rank 1 fails at boundary 3 while rank 0 is parked at it.
LANE = {"ainfer_pd": {"p_lane_min_tokens": 32, "segment_policy": "fixed", "p_host": "concurrent",
                      "timeout_s": 60.0}}


DELAY_S = 3.0


def test_tp2_one_rank_fails_while_the_other_goes_on(tiny_model, tmp_path):
    """On one TP=2 engine, rank 1's P fails twice while rank 0's goes on: first before it
    publishes boundary 3 (`b3`, between two segments) of epoch 0, then before its sixth
    collective (`c5`, inside a segment whose earlier collectives it already issued) of the first
    epoch after those requests. Without the replay rank 0's P waits in an all-reduce rank 1 never
    issues, and the engine ends at the lane's timeout; with it both ranks' logs of the whole run
    are one sequence. In the `b3` epoch the device work also completes only `DELAY_S` after its
    last kernel (a slow device): its jobs, and so their KV blocks, must stay held until then
    (reported at once, vLLM would hand the blocks to new requests while P may still write
    them)."""
    seeds = (3, 4, 5)  # b3's requests, c5's, then requests with no fault
    waves = [parity_waves(vocab_size=512, seed=seed) for seed in seeds]
    prompts = [[p for wave in w for p in wave] for w in waves]
    prefix = str(tmp_path / "collectives")
    with offline_llm(tiny_model, 2, backend="ainfer_pd",
                     additional_config={"ainfer_pd": {"mode": "normal"}}) as normal:
        normal_out = [run_waves(normal, w, MAX_TOKENS) for w in waves]
    with offline_llm(tiny_model, 2) as stock:
        stock_out = [run_waves(stock, w, MAX_TOKENS) for w in waves]
        with offline_llm(tiny_model, 2, backend="ainfer_pd", additional_config=LANE,
                         worker_extension_cls=WITH_LOG) as ours:
            llm = ours.llm
            llm.collective_rpc("start_collective_log", args=(prefix,))
            lanes, ours_out = [], []
            for k, w in enumerate(waves):
                if k == 0:
                    faults = {"fail_at": "0@1:b3", "device_delay": f"0:{DELAY_S}"}
                elif k == 1:  # the next epoch, numbered by the epochs both ranks have opened
                    faults = {"fail_at": f"{lanes[0][0]['epochs']}@1:c5"}
                else:
                    faults = {}
                assert llm.collective_rpc("inject_p_faults", kwargs=faults) == \
                    [{"rank": 0}, {"rank": 1}]
                ours_out.append(run_waves(ours, w, MAX_TOKENS))
                lanes.append([s["p_lane"] for s in ours.worker_status()])
            all_freed = llm.reset_prefix_cache()
        reports = [compare(p, b, o, stock.teacher_force)
                   for baseline in (normal_out, stock_out)
                   for p, b, o in zip(prompts, baseline, ours_out, strict=True)]
    print("vs normal, then vs stock:", reports, lanes)
    assert all(r.fail == 0 for r in reports), reports
    before = [{"jobs_failed": 0, "jobs_done": 0, "epochs": 0, "p_drain_s": 0.0}] * 2
    for k, (now, then) in enumerate(zip(lanes, [before, *lanes], strict=False)):
        failed = [a["jobs_failed"] - b["jobs_failed"] for a, b in zip(now, then, strict=True)]
        # Each failure failed that epoch's jobs on both TP ranks (they share its KV); the
        # requests with no fault failed none.
        assert (failed[0] == failed[1] > 0) if k < 2 else failed == [0, 0], (k, lanes)
        assert now[0]["epochs"] == now[1]["epochs"] > then[0]["epochs"], (k, lanes)
        assert now[0]["jobs_done"] > then[0]["jobs_done"], (k, lanes)
    # The failed jobs were held until the late device work was done: the delay runs from P's
    # last kernel, a little before the epoch closed, and reported at once they would show ~0 s.
    assert all(DELAY_S - 0.5 < f["p_drain_s"] < DELAY_S + 5 for f in lanes[0]), lanes[0]
    assert lanes[-1][0]["inflight"] == lanes[-1][1]["inflight"] == 0, lanes[-1]
    assert all_freed  # no request, and so no P reservation, holds a KV block
    logs = read_logs(prefix, 2)
    assert any(e.startswith("P ") for e in logs[0]), logs[0][:20]
    assert len(logs[0]) == len(logs[1]) and first_divergence(logs) is None, \
        first_divergence(logs)
