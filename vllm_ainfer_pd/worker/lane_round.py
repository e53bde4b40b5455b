"""The round contract between vLLM's worker and the P lane, written once."""

from __future__ import annotations

import abc

from vllm_ainfer_pd.turnstile import Load


class LaneRound(abc.ABC):
    """One turnstile round per D iteration, called on the worker's main thread of every rank.

    The worker calls, once per D iteration::

        lane.before_d()
        ...the whole D iteration...
        lane.after_d(load, d_tokens)

    **What goes between them.** Everything D enqueues for the step: the forward (real, or vLLM's
    dummy batch on an idle DP rank), sampling, and the speculative drafter's forward (EAGLE, a
    draft model, MTP) with its collectives. Nothing D enqueues for the step may come after
    `after_d`: `after_d` releases P's next segment, whose collectives then follow D's on every
    rank in the same order. In vLLM 0.26 a step with a forward is `execute_model` (which returns
    None) followed by `sample_tokens` (sampling and drafting): the round spans both calls.

    **What counts as a D iteration.** At DP=1, every step, 0-token steps too (they happen while
    every request is parked in P). At DP>1, every forward, real or dummy: the calls that all DP
    ranks make together (a 0-token `execute_model` there has no forward; vLLM follows it with a
    dummy batch, which is the round).

    **`before_d()`.** With a P epoch open: waits until P stopped at its permit (P's host work of
    the last segment is done), then the pre-D rendezvous. With none open it returns at once.

    **`after_d(load, d_tokens)`.** With an epoch open: the post-D rendezvous, then what the
    round plan (`turnstile/round_plan.py`) computed from every rank's payloads: release P's next
    segment (`load` picks how many boundaries), end the epoch, open the next. Otherwise it opens
    an epoch for queued jobs, if any. At DP>1 whether a round may open one (the epoch gate) is
    read from vLLM's own per-forward DP all-reduce (`vllm_glue.dp_sync`), the same answer on
    every rank, so a round with no P on any rank costs no rendezvous at all; a round that opens
    an epoch meets all ranks in both phases and shares each rank's tokens, so every DP rank
    opens it together. `d_tokens` is the step's D tokens (0 for a dummy batch).

    Every rank makes the same calls in the same order; every wait inside is bounded by the lane's
    `timeout_s` with an error naming the rank, the phase, the round and who is missing.
    """

    @abc.abstractmethod
    def before_d(self) -> None:
        """Before the D iteration's first enqueue."""

    @abc.abstractmethod
    def after_d(self, load: Load | None = None, d_tokens: int = 0) -> None:
        """After the D iteration's last enqueue (its drafter's included)."""
