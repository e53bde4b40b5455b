"""Rendezvous: barrier semantics, timeouts that name the missing ranks, and phase checks.

Shared memory is exercised with ranks as threads and as processes; gloo with real process groups.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from vllm_ainfer_pd.turnstile import (
    GlooRendezvous,
    NullRendezvous,
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
    ShmRendezvous,
)
from vllm_ainfer_pd.turnstile.launch import RankGroup, init_gloo
from vllm_ainfer_pd.turnstile.rendezvous import MAX_PAYLOAD

pytestmark = pytest.mark.timeout(120)


def shm_name() -> str:
    return f"ainfer_pd_test_{uuid.uuid4().hex[:12]}"


def run_threads(n, body):
    """Run body(rank) on n threads started together; return {rank: result or exception}."""
    out: dict[int, object] = {}
    start = threading.Barrier(n)

    def wrap(r):
        try:
            start.wait(10)
            out[r] = body(r)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=wrap, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return out


def phases_never_overlap(stamps):
    """stamps[rank] = [(enter, exit), ...] per phase: all ranks enter a phase before any leaves."""
    for per_phase in zip(*stamps.values(), strict=True):
        assert max(e for e, _ in per_phase) <= min(x for _, x in per_phase)


# --- shared memory, ranks as threads ----------------------------------------------------------


def test_shm_rendezvous_releases_no_rank_before_all_arrive():
    name, n, rounds = shm_name(), 4, 150
    created = threading.Event()

    def body(r):
        if r:
            created.wait(10)
        with ShmRendezvous(name, r, n, timeout_s=20) as rdv:
            created.set()
            stamps = []
            for j in range(rounds):
                time.sleep(0.0002 * ((r + j) % 3))  # skew which rank comes last
                for phase in (rdv.pre_d, rdv.post_d):
                    enter = time.monotonic()
                    phase()
                    stamps.append((enter, time.monotonic()))
            assert rdv.round == rounds
            time.sleep(0.05)  # let peers finish reading before the creator unlinks
            return stamps

    out = run_threads(n, body)
    assert all(isinstance(v, list) for v in out.values()), out
    phases_never_overlap(out)


def test_shm_timeout_names_rank_phase_round_and_the_ranks_that_never_arrived():
    name = shm_name()
    rdvs = [ShmRendezvous(name, 0, 4, timeout_s=0.5)]
    rdvs += [ShmRendezvous(name, r, 4, timeout_s=0.5) for r in (1, 2)]
    try:
        out = run_threads(3, lambda r: rdvs[r].pre_d())  # rank 3 never comes
    finally:
        for rdv in reversed(rdvs):
            rdv.close()
    for r, err in out.items():
        assert isinstance(err, RendezvousTimeout), err
        assert (err.rank, err.phase, err.round, err.missing) == (r, "pre_d", 0, (3,))
        assert "rank 3 never arrived" in str(err)


def test_shm_timeout_reports_where_the_late_rank_last_arrived():
    name = shm_name()
    rdvs = [ShmRendezvous(name, 0, 3, timeout_s=0.5)]
    rdvs += [ShmRendezvous(name, r, 3, timeout_s=0.5) for r in (1, 2)]

    def body(r):
        rdvs[r].pre_d()
        rdvs[r].post_d()
        rdvs[r].pre_d()
        if r != 2:
            rdvs[r].post_d()  # rank 2 stalls after pre_d of round 1

    try:
        out = run_threads(3, body)
    finally:
        for rdv in reversed(rdvs):
            rdv.close()
    for r in (0, 1):
        err = out[r]
        assert isinstance(err, RendezvousTimeout), err
        assert (err.phase, err.round, err.missing) == ("post_d", 1, (2,))
        assert "rank 2 last arrived at pre_d of round 1" in str(err)


def test_rendezvous_is_unusable_after_a_timeout():
    with ShmRendezvous(shm_name(), 0, 2, timeout_s=0.1) as rdv:
        with pytest.raises(RendezvousTimeout):
            rdv.pre_d()
        with pytest.raises(RendezvousError, match="unusable after an earlier failure"):
            rdv.pre_d()


def test_phases_out_of_order_are_rejected():
    rdv = NullRendezvous()
    with pytest.raises(RendezvousError, match=r"post_d of round 0.*expected pre_d"):
        rdv.post_d()
    rdv.pre_d()
    with pytest.raises(RendezvousError, match=r"pre_d of round 0.*expected post_d"):
        rdv.pre_d()


def test_shm_attach_times_out_naming_the_creator_when_the_segment_never_appears():
    with pytest.raises(RendezvousTimeout, match=r"rank 1 in attach.*never arrived: \[0\]"):
        ShmRendezvous(shm_name(), 1, 2, timeout_s=0.2)


def test_shm_attach_rejects_a_segment_made_for_another_world_size():
    name = shm_name()
    with ShmRendezvous(name, 0, 2):
        with pytest.raises(ValueError, match="world_size 2, not 3"):
            ShmRendezvous(name, 1, 3, timeout_s=1)


def test_null_rendezvous_counts_rounds():
    rdv = NullRendezvous()
    for _ in range(3):
        rdv.pre_d()
        rdv.post_d()
    assert rdv.round == 3


# --- across processes -------------------------------------------------------------------------


def _shm_rank(rank, world, port, name, rounds):
    rdv = ShmRendezvous(name, rank, world, timeout_s=30)
    stamps = []
    for j in range(rounds):
        if (rank + j) % world == 0:
            time.sleep(0.0005)
        for phase in (rdv.pre_d, rdv.post_d):
            enter = time.monotonic()
            phase()
            stamps.append((enter, time.monotonic()))
    rdv.pre_d()  # a final meeting so the creator does not unlink while a peer still reads
    rdv.close()
    return stamps


def test_shm_rendezvous_across_processes_releases_no_rank_early():
    with RankGroup(_shm_rank, 4, args=(shm_name(), 200)) as ranks:
        stamps = ranks.wait(90)
    phases_never_overlap(dict(enumerate(stamps)))


def _gloo_rank(rank, world, port, rounds, stall_rank, stall_at):
    init_gloo(rank, world, port)
    rdv = GlooRendezvous(timeout_s=1.0 if stall_rank is not None else 30.0)
    stamps = []
    try:
        for j in range(rounds):
            for k, phase in enumerate((rdv.pre_d, rdv.post_d)):
                if rank == stall_rank and (j, k) == stall_at:
                    time.sleep(3.0)  # never arrives within the peers' timeout
                    return "stalled"
                enter = time.monotonic()
                phase()
                stamps.append((enter, time.monotonic()))
    except RendezvousTimeout as err:
        time.sleep(1.0)  # rank 0 hosts the store its peers read to name the missing rank
        return ("timeout", err.rank, err.phase, err.round, err.missing, str(err))
    return stamps


def test_gloo_rendezvous_releases_no_rank_early():
    with RankGroup(_gloo_rank, 4, args=(40, None, None)) as ranks:
        stamps = ranks.wait(90)
    phases_never_overlap(dict(enumerate(stamps)))


def test_gloo_timeout_names_rank_phase_round_and_the_missing_rank():
    with RankGroup(_gloo_rank, 3, args=(5, 2, (1, 1))) as ranks:
        out = ranks.wait(90)
    assert out[2] == "stalled"
    for r in (0, 1):
        kind, rank, phase, rnd, missing, msg = out[r]
        assert (kind, rank, phase, rnd, missing) == ("timeout", r, "post_d", 1, (2,))
        assert "rank 2 last arrived at pre_d of round 1" in msg


def _gloo_mismatch_rank(rank, world, port):
    init_gloo(rank, world, port)
    rdv = GlooRendezvous(timeout_s=10)
    rdv.pre_d()
    rdv.post_d()
    if rank == 1:
        rdv = GlooRendezvous(timeout_s=10, name="restarted")  # starts again at round 0
    try:
        rdv.pre_d()
    except RendezvousMismatch as err:
        return str(err)
    return "no error"


def test_gloo_rendezvous_detects_ranks_standing_in_different_rounds():
    with RankGroup(_gloo_mismatch_rank, 2) as ranks:
        out = ranks.wait(60)
    assert all("different phases" in m for m in out), out
    assert "between pre_d of round 0 and pre_d of round 1" in out[0]


# --- payloads: every rank learns what every rank sent in the same phase -------------------------


def _payload_rounds(rdv, rank, rounds):
    """Each phase sends (rank, round, phase index); returns what every phase delivered."""
    seen = []
    for j in range(rounds):
        for k, phase in enumerate((rdv.pre_d, rdv.post_d)):
            # Ranks alternate sending nothing, so a stale value from the other parity would show.
            payload = () if (rank + j + k) % 3 == 0 else _full_payload(rank, j, k)
            phase(payload)
            seen.append(list(rdv.payloads))
    return seen


def _full_payload(rank, j, k):
    """MAX_PAYLOAD ints: the shm layout must hold them without touching the next rank's line."""
    payload = (rank, j, k, -(rank * 10_000 + j))
    assert len(payload) == MAX_PAYLOAD
    return payload


def _expected_payloads(world, rounds):
    return [[() if (r + j + k) % 3 == 0 else _full_payload(r, j, k) for r in range(world)]
            for j in range(rounds) for k in range(2)]


def test_shm_payloads_deliver_each_phase_values_to_every_rank():
    name, world, rounds = shm_name(), 3, 300
    creator = ShmRendezvous(name, 0, world, timeout_s=30)
    try:
        def body(r):
            rdv = creator if r == 0 else ShmRendezvous(name, r, world, timeout_s=30)
            return _payload_rounds(rdv, r, rounds)

        out = run_threads(world, body)
    finally:
        creator.close()
    for r in range(world):
        assert out[r] == _expected_payloads(world, rounds), f"rank {r}"


def test_payload_longer_than_the_limit_is_rejected_naming_it():
    rdv = NullRendezvous()
    with pytest.raises(ValueError, match=r"at most 4 ints, got \(1, 2, 3, 4, 5\)"):
        rdv.pre_d((1, 2, 3, 4, 5))
    rdv = NullRendezvous()
    rdv.pre_d((7,))
    assert rdv.payloads == [(7,)]


def _gloo_payload_rank(rank, world, port, rounds):
    init_gloo(rank, world, port)
    return _payload_rounds(GlooRendezvous(timeout_s=30), rank, rounds)


def test_gloo_payloads_deliver_each_phase_values_to_every_rank():
    with RankGroup(_gloo_payload_rank, 3, args=(20,)) as ranks:
        out = ranks.wait(90)
    for r in range(3):
        assert out[r] == _expected_payloads(3, 20), f"rank {r}"
