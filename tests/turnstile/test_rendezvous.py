"""Rendezvous: barrier semantics, timeouts that name the missing ranks, and phase checks.

Shared memory is exercised with ranks as threads and as processes; gloo and the hierarchical
rendezvous with real process groups, several "hosts" on this machine through `HOST_ID_ENV`.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from ainfer_pd_testing.launch import RankGroup, init_gloo
from vllm_ainfer_pd.config import RENDEZVOUS, AInferPDConfig, ConfigError
from vllm_ainfer_pd.turnstile import (
    HOST_ID_ENV,
    RENDEZVOUS_KINDS,
    GlooRendezvous,
    HierarchicalRendezvous,
    NullRendezvous,
    RendezvousAbandoned,
    RendezvousError,
    RendezvousMismatch,
    RendezvousTimeout,
    ShmRendezvous,
    choose_rendezvous,
    host_identity,
    make_rendezvous,
)
from vllm_ainfer_pd.turnstile.rendezvous import MAX_PAYLOAD, PAYLOAD_MAX, PAYLOAD_MIN
from vllm_ainfer_pd.turnstile.rendezvous.host_segment import _tagged, _untag

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


def test_a_rank_arriving_after_its_peer_timed_out_fails_naming_it_instead_of_going_on():
    """Rank 0 times out in pre_d of round 1; rank 1 arrives afterwards and finds every slot full.
    Going on would take it into D's collectives alone, so it fails naming rank 0."""
    name = shm_name()
    with ShmRendezvous(name, 0, 2, timeout_s=0.2) as r0, \
            ShmRendezvous(name, 1, 2, timeout_s=0.2) as r1:
        done = run_threads(2, lambda r: ((r0, r1)[r].pre_d(), (r0, r1)[r].post_d()))
        assert all(isinstance(v, tuple) for v in done.values()), done
        with pytest.raises(RendezvousTimeout) as first:
            r0.pre_d()
        assert type(first.value) is RendezvousTimeout and first.value.missing == (1,)
        with pytest.raises(RendezvousAbandoned) as late:
            r1.pre_d()
    err = late.value
    assert (err.rank, err.phase, err.round, err.missing) == (1, "pre_d", 1, ())
    assert "rank 0 timed out in pre_d of round 1" in str(err)


def test_ranks_waiting_with_a_peer_that_times_out_stop_too_and_name_the_missing_rank():
    name = shm_name()
    rdvs = [ShmRendezvous(name, 0, 3, timeout_s=0.3), ShmRendezvous(name, 1, 3, timeout_s=30)]
    try:
        start = time.monotonic()
        out = run_threads(2, lambda r: rdvs[r].pre_d())  # rank 2 never comes
        waited = time.monotonic() - start
    finally:
        for rdv in reversed(rdvs):
            rdv.close()
    assert type(out[0]) is RendezvousTimeout, out
    assert isinstance(out[1], RendezvousAbandoned) and out[1].missing == (2,), out
    assert "rank 0 timed out in pre_d of round 0; rank 2 never arrived" in str(out[1])
    assert waited < 10  # rank 1 stopped with rank 0, not after its own 30 s


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


# --- self-validating shared-memory words (ordering that holds on Arm) ---------------------------


def test_tagged_words_carry_48_bit_values_and_only_their_own_generation():
    for gen in (1, 2, 3, 0xFFFF, 0x10000, 0x10001, 2**40 + 5):
        for value in (0, 1, -1, 7, PAYLOAD_MIN, PAYLOAD_MAX, -(10**12)):
            word = _tagged(gen, value)
            assert -(2**63) <= word < 2**63  # what a 'q' memoryview stores
            assert _untag(word, gen) == value
            for other in (gen - 2, gen + 2, gen - 1):
                assert _untag(word, other) is None


def test_payload_values_beyond_48_bits_are_rejected_naming_them():
    rdv = NullRendezvous()
    with pytest.raises(ValueError, match=r"48-bit signed\), got \(1, 140737488355328\)"):
        rdv.pre_d((1, PAYLOAD_MAX + 1))
    rdv = NullRendezvous()
    rdv.pre_d((PAYLOAD_MIN, PAYLOAD_MAX))
    assert rdv.payloads == [(PAYLOAD_MIN, PAYLOAD_MAX)]


def _write_by_hand(rdv, gen, payload, tags=None):
    """What rank `rdv.rank` stores to arrive at `gen`, word by word; `tags[i]` overrides the
    generation tag of value word i (a store not yet visible to the reader)."""
    seg = rdv.segment
    base = seg._buffer(seg._mine, gen)
    seg._view[base] = _tagged(gen, len(payload))
    for i, value in enumerate(payload):
        seg._view[base + 1 + i] = _tagged(tags[i] if tags else gen, value)
    seg._view[seg._mine] = gen


@pytest.fixture
def reader_and_peer():
    """Rank 0 (a real reader) and rank 1 whose words the test writes by hand, past round 0: rank 1
    sent (7,) at generation 1, whose payload buffer generation 3 reuses."""
    name = shm_name()
    reader = ShmRendezvous(name, 0, 2, timeout_s=0.5)
    peer = ShmRendezvous(name, 1, 2, timeout_s=0.5)
    try:
        _write_by_hand(peer, 1, (7,))
        reader.pre_d()
        assert reader.payloads == [(), (7,)]
        _write_by_hand(peer, 2, ())
        reader.post_d()
        yield reader, peer
    finally:
        peer.close()
        reader.close()


def test_shm_reader_waits_out_a_payload_word_still_tagged_with_the_previous_generation(
        reader_and_peer):
    reader, peer = reader_and_peer
    # The slot and length word of generation 3 are visible, the value word is still generation 1's
    # (7): what an Arm reader can see when the peer's stores arrive out of order.
    _write_by_hand(peer, 3, (8,), tags=[1])
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(reader.pre_d)
        time.sleep(0.1)
        assert not done.done(), "returned with a stale payload word"
        _write_by_hand(peer, 3, (8,))  # the late store lands
        done.result(5)
    assert reader.payloads == [(), (8,)]


def test_shm_reader_accepts_no_word_of_another_generation_of_the_same_parity(reader_and_peer):
    reader, peer = reader_and_peer
    _write_by_hand(peer, 3, (8,), tags=[5])
    with pytest.raises(RendezvousTimeout, match="payload words never carried generation 3"):
        reader.pre_d()


# --- choosing a rendezvous from where the ranks run ---------------------------------------------


def test_config_offers_the_factory_kinds_and_defaults_to_auto():
    assert RENDEZVOUS == RENDEZVOUS_KINDS == ("auto", "shm", "gloo")
    assert AInferPDConfig().rendezvous == "auto"
    for kind in RENDEZVOUS:
        assert AInferPDConfig(rendezvous=kind).rendezvous == kind
    with pytest.raises(ConfigError, match="rendezvous='nccl' is not one of auto, shm, gloo"):
        AInferPDConfig(rendezvous="nccl")


def test_choose_rendezvous_by_host_layout():
    assert choose_rendezvous("auto", ["a"]) == "null"
    assert choose_rendezvous("shm", ["a"]) == "null"
    assert choose_rendezvous("auto", ["a", "a", "a"]) == "shm"
    assert choose_rendezvous("auto", ["a", "b", "a", "b"]) == "hierarchical"
    assert choose_rendezvous("auto", ["a", "a", "a", "b"]) == "hierarchical"
    assert choose_rendezvous("auto", ["a", "b", "c"]) == "gloo"
    assert choose_rendezvous("shm", ["a", "a"]) == "shm"
    assert choose_rendezvous("gloo", ["a", "a"]) == "gloo"
    with pytest.raises(ValueError, match="kind 'nccl' is not one of auto, shm, gloo"):
        choose_rendezvous("nccl", ["a", "a"])


def test_shm_across_hosts_is_one_line_naming_hosts_and_ranks():
    with pytest.raises(ValueError) as err:
        choose_rendezvous("shm", ["n1", "n1", "n2", "n2", "n1"])
    msg = str(err.value)
    assert "\n" not in msg
    assert "the 5 ranks are on 2 hosts (host 'n1': ranks 0-1, 4; host 'n2': ranks 2-3)" in msg
    assert "use 'auto'" in msg and "'gloo'" in msg


def test_host_identity_is_the_environment_override_or_this_machine(monkeypatch):
    monkeypatch.setenv(HOST_ID_ENV, "rack7-node3")
    assert host_identity() == "rack7-node3"
    monkeypatch.delenv(HOST_ID_ENV)
    assert host_identity().startswith(socket.gethostname())


def _auto_rank(rank, world, port):
    init_gloo(rank, world, port)
    layouts = {"one host": "aaaa", "two hosts": "abab", "uneven": "aaab", "one rank each": "abcd"}
    picked = {}
    for label, hosts in layouts.items():
        with make_rendezvous("auto", host=hosts[rank], timeout_s=30) as rdv:
            rdv.pre_d((rank, -10 * rank))
            payloads = list(rdv.payloads)
            rdv.post_d()  # peers finish reading before the segment's creator closes it
            picked[label] = (type(rdv).__name__, payloads)
    os.environ[HOST_ID_ENV] = "left" if rank < 2 else "right"  # read when the rendezvous is built
    with make_rendezvous("auto", timeout_s=30) as rdv:
        rdv.pre_d()
        picked["from the environment"] = type(rdv).__name__
    with make_rendezvous("gloo", timeout_s=30, name="kind-gloo") as rdv:
        rdv.pre_d()
        picked["gloo"] = type(rdv).__name__
    with make_rendezvous("shm", host="same", timeout_s=30) as rdv:
        rdv.pre_d()
        picked["shm"] = type(rdv).__name__
    return picked


def test_make_rendezvous_auto_picks_by_where_the_ranks_run():
    with RankGroup(_auto_rank, 4) as ranks:
        out = ranks.wait(120)
    sent = [(r, -10 * r) for r in range(4)]
    for picked in out:
        assert picked == {
            "one host": ("ShmRendezvous", sent),
            "two hosts": ("HierarchicalRendezvous", sent),
            "uneven": ("HierarchicalRendezvous", sent),
            "one rank each": ("GlooRendezvous", sent),
            "from the environment": "HierarchicalRendezvous",
            "gloo": "GlooRendezvous",
            "shm": "ShmRendezvous",
        }


def _one_rank(rank, world, port):
    init_gloo(rank, world, port)
    return [type(make_rendezvous(kind, timeout_s=5)).__name__ for kind in RENDEZVOUS_KINDS]


def test_make_rendezvous_gives_a_single_rank_the_null_rendezvous():
    with RankGroup(_one_rank, 1) as ranks:
        assert ranks.wait(60) == [["NullRendezvous"] * 3]


def _shm_two_hosts_rank(rank, world, port):
    init_gloo(rank, world, port)
    start = time.monotonic()
    try:
        make_rendezvous("shm", host=f"node-{rank}", timeout_s=60)
    except ValueError as err:
        return time.monotonic() - start, str(err)
    return None


def test_shm_on_two_hosts_fails_at_once_on_every_rank_with_one_line():
    with RankGroup(_shm_two_hosts_rank, 2) as ranks:
        out = ranks.wait(60)
    for result in out:
        assert result is not None, "no error"
        waited, msg = result
        assert waited < 5  # not the 60 s timeout: nothing waits for a segment
        assert "\n" not in msg
        assert "on 2 hosts (host 'node-0': ranks 0; host 'node-1': ranks 1)" in msg
        assert "'auto'" in msg and "'gloo'" in msg


# --- the hierarchical rendezvous: shared memory per host, gloo between leaders ------------------


def _mixed_payload(rank, j, k):
    """Empty, small, or at the range's ends, so every path of the word encoding is crossed."""
    kind = (rank + j + k) % 3
    if kind == 0:
        return ()
    if kind == 1:
        return _full_payload(rank, j, k)
    return (PAYLOAD_MIN + rank, PAYLOAD_MAX - j)


def _hierarchical_rank(rank, world, port, rounds, seed):
    # Hosts interleave (ranks 0 and 2 on one, 1 and 3 on the other) so a payload filed under a
    # host-local index instead of its group rank would show.
    os.environ[HOST_ID_ENV] = "host-a" if rank % 2 == 0 else "host-b"
    init_gloo(rank, world, port)
    rdv = make_rendezvous("auto", timeout_s=30)
    rng = random.Random(seed * 1000 + rank)
    seen, stamps = [], []
    for j in range(rounds):
        for k, phase in enumerate((rdv.pre_d, rdv.post_d)):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)  # random skew: any rank may come last
            enter = time.monotonic()
            phase(_mixed_payload(rank, j, k))
            stamps.append((enter, time.monotonic()))
            seen.append(list(rdv.payloads))
    rdv.pre_d()  # a final meeting so a leader does not unlink while a peer still reads
    rdv.close()
    return type(rdv).__name__, rdv.leader, seen, stamps


def test_hierarchical_rendezvous_delivers_every_payload_everywhere_over_skewed_rounds():
    world, rounds = 4, 200
    with RankGroup(_hierarchical_rank, world, args=(rounds, 1)) as ranks:
        out = ranks.wait(180)
    expected = [[_mixed_payload(r, j, k) for r in range(world)]
                for j in range(rounds) for k in range(2)]
    assert [(name, leader) for name, leader, _, _ in out] == [
        (HierarchicalRendezvous.__name__, leader) for leader in (0, 1, 0, 1)]
    for r, (_, _, seen, _) in enumerate(out):
        assert seen == expected, f"rank {r}"
    phases_never_overlap({r: stamps for r, (_, _, _, stamps) in enumerate(out)})


def _hierarchical_stall_rank(rank, world, port, stall_rank, stall_at):
    os.environ[HOST_ID_ENV] = "host-a" if rank < 2 else "host-b"
    init_gloo(rank, world, port)
    rdv = make_rendezvous("auto", timeout_s=2.0)
    try:
        for j in range(4):
            for k, phase in enumerate((rdv.pre_d, rdv.post_d)):
                if rank == stall_rank and (j, k) == stall_at:
                    time.sleep(4.5)  # never arrives within the peers' timeout
                    return "stalled"
                phase()
    except RendezvousTimeout as err:
        time.sleep(1.5)  # rank 0 hosts the store its peers read to name the missing rank
        return err.rank, err.phase, err.round, err.missing, str(err)
    return "no timeout"


def test_hierarchical_timeout_names_the_rank_that_never_arrived_on_every_host():
    # Rank 3 (host-b, not its leader) stalls before post_d of round 1.
    with RankGroup(_hierarchical_stall_rank, 4, args=(3, (1, 1))) as ranks:
        out = ranks.wait(120)
    assert out[3] == "stalled"
    for r in (0, 1, 2):
        rank, phase, rnd, missing, msg = out[r]
        assert (rank, phase, rnd, missing) == (r, "post_d", 1, (3,)), msg
        assert "timed out" in msg and "rank 3" in msg
        assert "last arrived at pre_d of round 1" in msg
    for r in (0, 1):  # across hosts, the error says where rank 3 runs
        assert "rank 3 (host 'host-b') last arrived at pre_d of round 1" in out[r][4]


def test_hierarchical_timeout_names_a_host_whose_leader_never_arrived():
    # Rank 2 (host-b's leader) stalls before pre_d of round 2: its host-mate names it from the
    # shared segment; host-a's ranks, with no word from host-b, name the host and its leader.
    with RankGroup(_hierarchical_stall_rank, 4, args=(2, (2, 0))) as ranks:
        out = ranks.wait(120)
    assert out[2] == "stalled"
    rank, phase, rnd, missing, msg = out[3]
    assert (rank, phase, rnd, missing) == (3, "pre_d", 2, (2,)), msg
    assert "rank 2 last arrived at post_d of round 1" in msg
    for r in (0, 1):
        rank, phase, rnd, missing, msg = out[r]
        assert (rank, phase, rnd, missing) == (r, "pre_d", 2, (2,)), msg
        assert "host 'host-b' (ranks 2-3, leader rank 2) last arrived at post_d of round 1" in msg
