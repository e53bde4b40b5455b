"""`LaneStats`: one rank's P lane counters, exported as `vllm_ainfer_pd_*` (`metrics.py`)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class LaneStats:
    """Counters of one rank since start (times in seconds). Exported as `vllm_ainfer_pd_*`."""

    epochs: int = 0
    segments: int = 0
    segments_after_d: int = 0  # segments released right after a D forward that had tokens
    jobs_done: int = 0
    jobs_cancelled: int = 0
    jobs_failed: int = 0
    p_tokens: int = 0
    rounds: int = 0  # D iterations with a P epoch open
    d_wait_s: float = 0.0  # the main thread waited for P's host work to stop at its permit
    p_permit_wait_s: float = 0.0  # P waited parked for its next permit
    p_enqueue_s: float = 0.0  # P's host time issuing segments
    # The part of it P's thread ran on a core (Python, and the CUDA driver's launch work); off a
    # core it waited for the GIL or slept in a blocking call (on GPU none is expected:
    # benchmarks/profile_lane.py).
    p_enqueue_cpu_s: float = 0.0
    rendezvous_s: float = 0.0
    rendezvous_phases: int = 0  # pre-D and post-D phases this rank met its peers in
    p_collectives_routed: int = 0  # P collectives issued on D's stream (CPU: counted only)
    # P's calls on its own expert-parallel state (docs/deepep.md): collectives on P's own
    # communicators (also counted as routed where they cross a D group), DeepEP normal-mode
    # dispatches. Updated when an epoch ends.
    p_collectives_own: int = 0
    phase_ep_rebuilds: int = 0  # P's own state rebuilt after a failed epoch that used it
    # Closed epochs' wait, from the end of their host work until their device work drained and
    # their jobs were reported (their KV blocks handed back): on CPU 0 but for a test's delay.
    p_drain_s: float = 0.0
    # DP > 1, the epoch gate (round_plan.EpochGate): rounds with lane work queued on some rank in
    # which the gate kept the epoch closed; over the epochs opened, the sum of the fullest
    # rank's tokens and of all ranks' tokens (rank utilisation = all / (DP x fullest)).
    gate_waits: int = 0
    epoch_max_rank_tokens: int = 0
    epoch_all_rank_tokens: int = 0
    # With `overlap_timing` on GPU: P's device time and the part of it D overlapped (overlap.py).
    p_device_s: float = 0.0
    p_overlap_s: float = 0.0
    inflight: int = 0  # P jobs queued or running (a gauge)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self, rank: int) -> str:
        """One log line of the counters."""
        return (
            f"P lane rank {rank}: {self.epochs} epochs, {self.segments} segments "
            f"({self.segments_after_d} after a D forward), jobs done/cancelled/failed "
            f"{self.jobs_done}/{self.jobs_cancelled}/{self.jobs_failed}, {self.p_tokens} P "
            f"tokens; D waited {self.d_wait_s:.3f} s, P parked {self.p_permit_wait_s:.3f} s, "
            f"P enqueue {self.p_enqueue_s:.3f} s ({self.p_enqueue_cpu_s:.3f} s on a core), "
            f"rendezvous {self.rendezvous_s:.3f} s"
        )
