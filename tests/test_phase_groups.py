"""P's own expert-parallel communicators (`deepep.phase_groups`, `vllm_glue.moe_phase`) over real
gloo groups: two rank processes build vLLM's DP=2 + EP groups on the CPU, then P's copies, and
run vLLM's all-gather/reduce-scatter dispatch and combine (`get_ep_group().dispatch_router_logits`
/ `.combine`, the MoE runner's calls) from a D thread and a P thread at once.

The hazard it guards: ranks issue P's and D's collectives in different orders (P runs beside D,
ordered by nothing but the turnstile's host phases). Rank 0 issues D's dispatch first, rank 1
P's first. On shared communicators the first call of each rank pairs with the other's, so each
phase receives the other's tokens (the negative control shows it); on P's own they cannot meet.
"""

from __future__ import annotations

import threading
import time

import pytest

from ainfer_pd_testing.launch import RankGroup, init_gloo

# ~30 s on an idle machine (two processes import vLLM); bounded generously for a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HIDDEN = 4
ROUNDS = 3
GONE_TIMEOUT_S = 3.0


def _vllm_groups(rank: int, world_size: int):
    """vLLM's DP x EP groups on the CPU (gloo), as a DP rank's worker builds them; its config."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from vllm_ainfer_pd.vllm_glue import cpu_compat

    cpu_compat.install()  # the CPU communicator's all_gatherv / reduce_scatterv
    config = VllmConfig(parallel_config=ParallelConfig(
        data_parallel_size=world_size, data_parallel_rank=rank, enable_expert_parallel=True))
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(1, 0, "env://", rank, "gloo")
        parallel_state.initialize_model_parallel(1, 1)
    return config


def _exchange(config, rank: int, world_size: int, tag: int) -> tuple[str, bool]:
    """One MoE dispatch + combine of this rank's `rank + 1` tokens, all valued `tag * 100 +
    rank`. Returns the EP group it used and whether both results were right: dispatch gathers
    every rank's tokens in rank order; combine sums each token's rows over ranks."""
    import torch
    from vllm.distributed import get_ep_group
    from vllm.forward_context import get_forward_context, set_forward_context

    counts = torch.tensor([r + 1 for r in range(world_size)], dtype=torch.int32)
    mine = torch.full((rank + 1, HIDDEN), float(tag * 100 + rank))
    logits = mine[:, :2].clone()
    with (set_forward_context(None, config, num_tokens=rank + 1, num_tokens_across_dp=counts),
          get_forward_context().dp_metadata.sp_local_sizes(1)):  # as vLLM's MoE runner does
        group = get_ep_group()
        gathered, _ = group.dispatch_router_logits(mine, logits)
        combined = group.combine(gathered)
    expected = torch.cat([torch.full((r + 1, HIDDEN), float(tag * 100 + r))
                          for r in range(world_size)])
    ok = torch.equal(gathered, expected) and torch.equal(combined, mine * world_size)
    return group.unique_name, ok


def _setup(rank: int, world_size: int, port: int):
    init_gloo(rank, world_size, port)
    from vllm.config import set_current_vllm_config

    from vllm_ainfer_pd.deepep.phase_groups import PhaseGroups
    from vllm_ainfer_pd.vllm_glue import moe_phase
    from vllm_ainfer_pd.worker import phase_state

    config = _vllm_groups(rank, world_size)
    with set_current_vllm_config(config):
        groups = PhaseGroups.build()
    phase_state.install()
    moe_phase.set_marker(phase_state._P)
    return config, groups


def _on_p_thread(fn):
    """Run `fn()` on a thread marked as P (`phase_state.enter_p`); return its result."""
    from vllm_ainfer_pd.worker import phase_state

    out: list = []

    def body() -> None:
        phase_state.enter_p(None)
        try:
            out.append(fn())
        finally:
            phase_state.leave_p()

    t = threading.Thread(target=body, name="ainfer-pd-P0")
    t.start()
    t.join(60)
    return out[0]


def _crossed_orders(config, rank: int, world_size: int) -> dict:
    """D (main thread, tag 1) and P (a P thread, tag 2) exchange ROUNDS times; rank 0 issues D's
    first call before P's, rank 1 P's before D's."""
    results: dict[str, list] = {"D": [], "P": []}
    first_issued = threading.Event()

    def run(phase: str, tag: int, goes_first: bool) -> None:
        for i in range(ROUNDS):
            if i == 0 and not goes_first:
                first_issued.wait(30)
                time.sleep(0.2)  # the other phase's first call is inside gloo by now
            if i == 0 and goes_first:
                first_issued.set()
            results[phase].append(_exchange(config, rank, world_size, tag))

    d_first = rank == 0
    p_thread = threading.Thread(target=lambda: _on_p_thread(lambda: run("P", 2, not d_first)))
    p_thread.start()
    run("D", 1, d_first)
    p_thread.join(60)
    return results


def _scenarios_rank(rank: int, world_size: int, port: int) -> dict:
    """The three scenarios, in one pair of processes (vLLM's import and groups cost seconds)."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config

    from vllm_ainfer_pd.deepep.manager import PhaseEP
    from vllm_ainfer_pd.vllm_glue import moe_phase

    config, groups = _setup(rank, world_size, port)
    out: dict = {"p_groups": groups.describe()}

    # 1. P's own groups: D's and P's calls in opposite orders on the two ranks.
    moe_phase.install_group_view(groups)
    out["own"] = _crossed_orders(config, rank, world_size)

    # 2. A P epoch fails after issuing collectives on P's groups, on rank 1 only: its groups are
    # retired; both ranks rebuild at one agreed point (the lane agrees on it in its rendezvous;
    # here one all-gather over the world), and P's next exchange runs on the new groups.
    state = PhaseEP(groups=groups)
    old = dict(groups.groups)
    state.open_epoch()
    out["before"] = _on_p_thread(lambda: _exchange(config, rank, world_size, 3))
    state.note_collective()  # the lane counts each collective on P's own groups
    state.close_epoch(failed=rank == 1)
    out["retired_here"] = state.retired
    flags = [None] * world_size
    dist.all_gather_object(flags, state.retired)
    if any(flags):
        with set_current_vllm_config(config):
            state.rebuild(timeout_s=60, rank=rank)
    out["after"] = _on_p_thread(lambda: _exchange(config, rank, world_size, 4))
    out["old_destroyed"] = all(not hasattr(g, "device_group") for g in old.values())
    out["rebuilds"], out["retired_now"] = state.rebuilds, state.retired

    # 3. Negative control: without P's own groups P's getters return D's.
    moe_phase.install_group_view(None)
    out["shared"] = _crossed_orders(config, rank, world_size)

    # 4a. Rank 1 shuts down (then leaves): its P communicators are destroyed, within the bound.
    if rank == 1:
        live = dict(groups.groups)
        state.close(timeout_s=GONE_TIMEOUT_S, rank=rank)
        out["closed"] = (groups.groups == {}
                         and all(not hasattr(g, "device_group") for g in live.values()))

    # 4. A peer gone mid-rebuild: rank 1 leaves; rank 0's rebuild (new communicators over the
    # world, whose creation waits for rank 1 with gloo's 30-minute default) must end with the
    # lane's named error within the bound instead.
    if rank == 0:
        from vllm_ainfer_pd.turnstile.errors import DrainTimeout

        start = time.monotonic()
        try:
            with set_current_vllm_config(config):
                state.rebuild(timeout_s=GONE_TIMEOUT_S, rank=rank)
            out["gone"] = ("rebuilt without its peer", time.monotonic() - start)
        except DrainTimeout as exc:
            out["gone"] = (str(exc), time.monotonic() - start)
    return out


@pytest.fixture(scope="module")
def scenarios() -> list[dict]:
    with RankGroup(_scenarios_rank, 2) as ranks:
        return ranks.wait(480)


def test_p_and_d_dispatch_in_opposite_orders_on_two_ranks_meet_only_their_own_phase(scenarios):
    for rank, r in enumerate(scenarios):
        d, p = r["own"]["D"], r["own"]["P"]
        assert len(d) == len(p) == ROUNDS, r
        assert all(ok for _, ok in d + p), (rank, r)
        # D's calls resolved to vLLM's EP group, P's to P's copy (the next "ep" name).
        assert {name for name, _ in d} == {"ep:0"}, r
        assert {name for name, _ in p} == {"ep:1"}, r
        assert "ep ep:1 ranks [0, 1]" in r["p_groups"] and "dp dp:1 ranks [0, 1]" in r["p_groups"]


def test_a_failed_epoch_retires_p_groups_and_every_rank_rebuilds_them(scenarios):
    assert [r["retired_here"] for r in scenarios] == [False, True], scenarios
    for r in scenarios:
        assert r["before"] == ("ep:1", True), r
        assert r["after"] == ("ep:2", True), r  # the rebuilt group, the next "ep" name
        assert r["old_destroyed"] and r["rebuilds"] == 1 and not r["retired_now"], r


def test_a_peer_gone_mid_rebuild_ends_the_rebuild_with_a_named_error_within_the_bound(scenarios):
    what, waited = scenarios[0]["gone"]
    assert what.startswith("waited for P's expert-parallel state (stateless) to be destroyed "
                           "and re-created on every rank (rank 0, epoch None): not done after "
                           "3 s"), what
    assert GONE_TIMEOUT_S <= waited < GONE_TIMEOUT_S + 10, waited


def test_shutdown_destroys_p_groups_within_the_bound(scenarios):
    assert scenarios[1]["closed"] is True, scenarios[1]


def test_negative_control_shared_communicators_pair_p_with_d(scenarios):
    """The first call of rank 0 (D's) meets the first call of rank 1 (P's): wrong tokens."""
    first = [(r["shared"]["D"][0], r["shared"]["P"][0]) for r in scenarios]
    assert all(name == "ep:0" for pair in first for name, _ in pair), first
    assert not all(ok for pair in first for _, ok in pair), first
