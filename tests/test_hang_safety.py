"""Hang safety: a rank that stalls makes its peers fail within the configured timeout, with an error
that names the late rank and where it last stood, and the client gets an error instead of a hang;
a P that does not stop at its permit within the timeout ends the engine step before D runs
beside it.

The faults are injected through the lane's fault hooks (`ainfer_pd_testing.faults`, installed in
the workers by `collective_rpc` once the engine is up): at TP=2 rank 1 sleeps just before its
pre-D rendezvous of round 3 (inside a P epoch); at TP=1 P sleeps past the timeout before each
boundary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

TIMEOUT_S = 8.0

SCENARIO = textwrap.dedent(
    """
    import sys, time
    from ainfer_pd_testing.parity import offline_llm, parity_waves

    def main():
        # K=1: the epoch spans round 3 whatever the load (the stall is checked inside epochs).
        lane = {"ainfer_pd": {"p_lane_min_tokens": 32, "segment_policy": "fixed",
                              "timeout_s": %(timeout)s}}
        with offline_llm(sys.argv[1], %(tp)s, backend="ainfer_pd", additional_config=lane,
                         worker_extension_cls="ainfer_pd_testing.faults.FaultInjection") as llm:
            print("ENGINE UP", flush=True)
            installed = llm.llm.collective_rpc("inject_p_faults", kwargs=%(faults)s)
            print(f"FAULTS INSTALLED {installed}", flush=True)
            start = time.monotonic()
            try:
                llm.generate(parity_waves(512)[0], 16)
            except Exception as exc:
                print(f"CLIENT ERROR after {time.monotonic() - start:.1f} s: "
                      f"{type(exc).__name__}: {exc}", flush=True)
                return
            print("CLIENT GOT OUTPUTS", flush=True)

    if __name__ == "__main__":
        main()
    """
)


def run_scenario(tmp_path, model: str, tp: int, faults: dict) -> tuple[str, str]:
    """The scenario in a subprocess; its output and the output's last 60 lines."""
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO % {"timeout": TIMEOUT_S, "tp": tp, "faults": repr(faults)})
    # Its own session, so that a worker left behind (one that went on into a collective its
    # peer never joins) is killed with the group rather than holding the pipe open.
    proc = subprocess.Popen([sys.executable, str(script), model], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("the scenario did not end within 300 s (a rank left behind?):\n"
                    + "\n".join(out.splitlines()[-60:]))
    return out, "\n".join(out.splitlines()[-60:])


def test_a_stalled_rank_fails_its_peer_with_an_error_naming_it(tiny_model, tmp_path):
    out, tail = run_scenario(tmp_path, tiny_model, 2, {"stall": "1:3"})
    assert "ENGINE UP" in out and "FAULTS INSTALLED [{'rank': 0}, {'rank': 1}]" in out, tail
    assert "CLIENT GOT OUTPUTS" not in out, tail
    assert "CLIENT ERROR after" in out, tail
    waited = float(out.split("CLIENT ERROR after ")[1].split(" s")[0])
    # The peer gives up after timeout_s; the rest is vLLM tearing the engine down.
    assert TIMEOUT_S <= waited < TIMEOUT_S + 90, tail
    # Rank 0's error names itself, the phase and round it waited in, and the late rank 1.
    assert "RendezvousTimeout" in out, tail
    line = next(x for x in out.splitlines() if "RendezvousTimeout" in x and "rank 1" in x)
    assert "rank 0" in line and "pre_d" in line and "round 3" in line, line
    assert "rank 1 last arrived at post_d of round 2" in line, line
    # Rank 1 wakes after rank 0 gave up and finds every slot full; it must not go on into D's
    # all-reduce alone (vLLM's CPU all-reduce would spin there for good) but fail naming rank 0.
    late = next((x for x in out.splitlines() if "errors.RendezvousAbandoned:" in x), "")
    assert "rank 1 in pre_d of round 3" in late, tail
    assert "rank 0 timed out in pre_d of round 3" in late, late
    print(line)


def test_a_p_that_does_not_stop_in_time_ends_the_step_before_d_runs_beside_it(tiny_model,
                                                                               tmp_path):
    """P sleeps 1.25 x `timeout_s` before each boundary: D's wait for P's stop at its permit
    times out. D must not begin its next iteration with P still running toward the permit (at
    TP > 1 P's next collective would pair with D's on their shared communicator): the engine
    step ends with the wait's error, naming the rank, the epoch and the boundary awaited. (The
    lane used to mark the epoch failed and go on: D's next round began while P slept, and the
    epoch's jobs were recomputed after D had run beside P.)"""
    out, tail = run_scenario(tmp_path, tiny_model, 1, {"slow_boundary_s": 1.25 * TIMEOUT_S})
    assert "FAULTS INSTALLED [{'rank': 0}]" in out, tail
    assert "CLIENT GOT OUTPUTS" not in out and "CLIENT ERROR after" in out, tail
    assert "while P was between boundaries" not in out, tail
    line = next((x for x in out.splitlines() if "errors.MissingProducerError:" in x), "")
    assert "no producer published the awaited boundary (rank 0, epoch 0, boundary" in line, tail
    assert f"waited {TIMEOUT_S:.3g} s" in line, line
