"""Crossed cycle: the naive order hangs (diagnosed, bounded); the turnstile completes."""

from __future__ import annotations

import pytest

from ainfer_pd_testing.crossed_cycle import Config, run

pytestmark = pytest.mark.timeout(150)

CFG = Config(rounds=6, boundaries=6, span=1, skew_ms=4.0, stall_s=1.0, timeout_s=15.0)


def test_naive_issue_order_hangs_and_the_watchdog_prints_the_cycle():
    lines: list[str] = []
    summary = run("naive", [0, 1], CFG, log=lines.append)
    assert summary["hung"] >= 1, "\n".join(lines)
    hang = next(s for s in summary["per_seed"] if s["outcome"] == "hang")
    assert hang["cycle"] is not None and len(hang["cycle"]) >= 3  # e.g. [0, 2, 0]
    text = "\n".join(lines)
    assert "HANG" in text and "waits for rank" in text and "cycle:" in text


def test_turnstile_orders_the_same_work_and_completes_every_seed():
    lines: list[str] = []
    summary = run("turnstile", [0, 1, 2], CFG, log=lines.append)
    assert summary["completed"] == 3, "\n".join(lines)
    assert all(s["same_order_on_all_ranks"] for s in summary["per_seed"])
