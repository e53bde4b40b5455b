"""Fixtures shared by the turnstile tests: real producer threads that are always joined."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vllm_ainfer_pd.turnstile import SegmentController


class ProducerThread(threading.Thread):
    """Runs `body(controller)` on its own thread and keeps what it raised (or returned)."""

    def __init__(self, controller: SegmentController, body: Callable[[SegmentController], Any],
                 name: str = "P") -> None:
        super().__init__(name=name, daemon=True)
        self.controller = controller
        self.body = body
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.body(self.controller)
        except BaseException as exc:  # the test inspects it
            self.error = exc


@pytest.fixture
def producer() -> Iterator[Callable[..., ProducerThread]]:
    """`producer(controller, body, name="P")` starts a thread; all are joined at teardown."""
    threads: list[ProducerThread] = []

    def start(controller: SegmentController, body: Callable[[SegmentController], Any],
              name: str = "P") -> ProducerThread:
        t = ProducerThread(controller, body, name)
        threads.append(t)
        t.start()
        return t

    yield start
    for t in threads:
        t.controller.cancel("test teardown")
        t.join(10)
        assert not t.is_alive(), f"producer thread {t.name} did not stop"


def publish_body(epoch: int, boundaries: int, *, finish: bool = True) -> Callable[..., list[int]]:
    """A producer body publishing boundaries 0..boundaries-1 of `epoch`, then finishing."""

    def body(ctrl: SegmentController) -> list[int]:
        seen = []
        for i in range(boundaries):
            ctrl.reach(epoch, i)
            seen.append(i)
        if finish:
            ctrl.finish(epoch)
        return seen

    return body


@pytest.fixture
def publish() -> Callable[..., Callable[..., list[int]]]:
    """`publish(epoch, n, finish=True)`: a producer body for boundaries 0..n-1 of `epoch`."""
    return publish_body
