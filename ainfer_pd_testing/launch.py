"""Start a few rank processes on this host, for the scripts and multi-process tests.

Children come from a forkserver that pre-imports torch once (a fresh torch import costs seconds),
report one result each through a queue, and are always terminated by the parent: `RankGroup`
kills stragglers on exit, so a hung collective never outlives its test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_CTX: Any = None


def context() -> Any:
    """The multiprocessing context used for rank processes (forkserver, torch pre-imported)."""
    global _CTX
    if _CTX is None:
        # Ranks abandoned after a diagnosed hang make torch's C++ store client log warnings with
        # stack frames when rank 0 (the store host) exits first; keep their logs to errors.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "vllm_ainfer_pd.turnstile"])
    return _CTX


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> None:
    """`torch.distributed.init_process_group("gloo")` over tcp://127.0.0.1:port."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


class RankFailed(RuntimeError):
    """A rank raised, or did not report within the deadline."""


class RankGroup:
    """Run `target(rank, world_size, port, *args)` in `world_size` processes.

    Use as a context manager; `wait(timeout_s)` returns the results in rank order or raises
    `RankFailed` naming the ranks that raised (with their tracebacks) or never reported. Leaving
    the context terminates, then kills, every child still alive.
    """

    def __init__(self, target: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                 port: int | None = None) -> None:
        self.world_size = world_size
        self.port = port or free_port()
        ctx = context()
        self._queue = ctx.Queue()
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self._procs = [ctx.Process(target=_rank_entry, name=f"rank{r}", daemon=True,
                                   args=(target, r, world_size, self.port, self._queue,
                                         tuple(args)))
                       for r in range(world_size)]

    def __enter__(self) -> RankGroup:
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def poll(self, timeout_s: float = 0.05) -> bool:
        """Collect reports for up to `timeout_s`; True once every rank has reported."""
        deadline = time.monotonic() + timeout_s
        while len(self.results) + len(self.errors) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                rank, ok, value = self._queue.get(timeout=min(left, 0.05))
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    self._drain()
                    return True
                continue
            (self.results if ok else self.errors)[rank] = value
        return True

    def wait(self, timeout_s: float) -> list[Any]:
        """Results in rank order; raise `RankFailed` on any error or missing report."""
        self.poll(timeout_s)
        missing = [r for r in range(self.world_size)
                   if r not in self.results and r not in self.errors]
        if self.errors or missing:
            lines = [f"rank {r} raised:\n{tb}" for r, tb in sorted(self.errors.items())]
            if missing:
                lines.append(f"ranks {missing} did not report within {timeout_s:.3g} s")
            raise RankFailed("\n".join(lines))
        return [self.results[r] for r in range(self.world_size)]

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.is_alive()]

    def terminate(self, grace_s: float = 2.0) -> None:
        """Terminate every child still alive, then kill those that ignore SIGTERM."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        self._queue.close()

    def _drain(self) -> None:
        while True:
            try:
                rank, ok, value = self._queue.get(timeout=0.2)
            except queue.Empty:
                return
            (self.results if ok else self.errors)[rank] = value


def _rank_entry(target: Callable[..., Any], rank: int, world_size: int, port: int, q: Any,
                args: tuple[Any, ...]) -> None:
    try:
        q.put((rank, True, target(rank, world_size, port, *args)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        # Flush the queue, then leave without running atexit/destructors: a gloo group with a
        # collective still pending (a diagnosed hang) could otherwise block interpreter exit.
        q.close()
        q.join_thread()
        os._exit(0)
