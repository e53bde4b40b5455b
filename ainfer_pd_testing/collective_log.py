"""A worker extension that records, per rank, every collective its threads issue through vLLM's
`GroupCoordinator` (which thread: D's main thread or the lane's P thread; which collective, group
and shape), and can delay one rank's speculative drafting, to widen the window in which a P
segment released too early would issue its collectives between D's and the drafter's.

`LLM(..., worker_extension_cls="ainfer_pd_testing.collective_log.CollectiveLog")`, then
`llm.collective_rpc("start_collective_log", args=(prefix, delay_rank, delay_s))`; each rank
appends one line per collective to `<prefix>.<world rank>` (flushed at once, D's before it is
issued and P's once issued, since a failed rank's replay returns stand-ins for the ones it issued
before it failed; the files tell
where ranks diverged even if the engine then hangs). `read_logs(prefix, ranks)` reads them back.
"""

from __future__ import annotations

import functools
import threading
import time

# vLLM's collective entry points on GroupCoordinator that a forward reaches (outermost calls and
# the ones they delegate to: both are recorded, in the order issued).
COLLECTIVES = ("_all_reduce_out_place", "all_gather", "all_gatherv", "reduce_scatter",
               "reduce_scatterv", "dispatch_router_logits", "dispatch", "combine", "broadcast")
P_THREAD_PREFIX = "ainfer-pd-P"  # the lane names its P thread so


def _shape(args: tuple) -> tuple[int, ...]:
    first = args[0] if args else None
    return tuple(getattr(first, "shape", ()))


class CollectiveLog:
    def start_collective_log(self, prefix: str, delay_rank: int = -1,
                             delay_s: float = 0.0) -> None:
        import torch.distributed as dist
        from vllm.distributed.parallel_state import GroupCoordinator

        from vllm_ainfer_pd.vllm_glue import collectives

        rank = dist.get_rank()
        out = open(f"{prefix}.{rank}", "a", buffering=1)  # noqa: SIM115 - lives with the worker
        lock = threading.Lock()

        def record(collective):
            @functools.wraps(collective)
            def wrapper(group, *args, **kwargs):
                if group.world_size == 1:  # issues nothing (vLLM returns the input)
                    return collective(group, *args, **kwargs)
                entry = f"{collective.__name__} {group.unique_name} {_shape(args)}"
                if not threading.current_thread().name.startswith(P_THREAD_PREFIX):
                    with lock:
                        out.write(f"D {entry}\n")
                    return collective(group, *args, **kwargs)
                # P's, once issued: a failed rank's replay returns stand-ins for the ones it had
                # issued before it failed, which its peers do not issue again.
                result = collective(group, *args, **kwargs)
                if not collectives.took_stand_in():
                    with lock:
                        out.write(f"P {entry}\n")
                return result

            return wrapper

        for name in COLLECTIVES:
            collective = getattr(GroupCoordinator, name, None)
            if collective is not None:
                setattr(GroupCoordinator, name, record(collective))
        if rank == delay_rank and delay_s > 0:
            # The drafter's entry: the V1 runner's method, or Model Runner V2's speculator's.
            runner = self.model_runner
            owner, name = ((runner, "propose_draft_token_ids")
                           if hasattr(runner, "propose_draft_token_ids")
                           else (runner.speculator, "propose"))
            propose = getattr(owner, name)

            @functools.wraps(propose)
            def delayed(*args, **kwargs):
                time.sleep(delay_s)  # between the step's forward and its drafter's
                return propose(*args, **kwargs)

            setattr(owner, name, delayed)


def read_logs(prefix: str, ranks: int) -> list[list[str]]:
    """Each rank's recorded collectives, in the order it issued them."""
    logs = []
    for rank in range(ranks):
        with open(f"{prefix}.{rank}") as f:
            logs.append(f.read().splitlines())
    return logs


def first_divergence(logs: list[list[str]]) -> str | None:
    """Where the ranks' sequences of collectives first differ (None if they never do; a rank's
    shorter log must be a prefix of the others')."""
    for i, entries in enumerate(zip(*logs)):
        if len(set(entries)) > 1:
            return f"collective {i}: " + " | ".join(f"rank {r}: {e}" for r, e in
                                                    enumerate(entries))
    return None
