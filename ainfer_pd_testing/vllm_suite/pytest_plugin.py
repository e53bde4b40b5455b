"""pytest plugin of a vLLM suite run (`-p ainfer_pd_testing.vllm_suite.pytest_plugin`): writes
each test's outcome, duration, first error line and the P-lane jobs it ran to
`--vllm-suite-report` (JSON), read by `benchmarks/vllm_tests.py`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ainfer_pd_testing.vllm_suite import LOG_ENV


def pytest_addoption(parser) -> None:
    parser.addoption("--vllm-suite-report", default=None, help="JSON file of per-test results")


def _events() -> list[str]:
    folder = os.environ.get(LOG_ENV)
    path = Path(folder, "events.log") if folder else None
    if path is None or not path.exists():
        return []
    return path.read_text().splitlines()


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[str, dict] = {}
        self._seen = 0

    def _lane_jobs_since_last(self) -> int:
        events = _events()
        new, self._seen = events[self._seen:], len(events)
        # Jobs run outside a test (a module fixture's engine warming up) go to the next test.
        return sum(1 for e in new if e.startswith("pjob "))

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.results.setdefault(
            report.nodeid, {"outcome": "passed", "duration": 0.0, "message": "", "lane_jobs": 0})
        entry["duration"] += report.duration
        if report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["message"] = _first_line(report)
        elif report.failed:
            # A failure in setup or teardown (an engine that did not start) is a failure too.
            entry["outcome"] = "failed"
            entry["message"] = entry["message"] or f"{report.when}: {_first_line(report)}"
        if report.when == "teardown":
            entry["lane_jobs"] += self._lane_jobs_since_last()
            self._write()

    def pytest_sessionfinish(self) -> None:
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def _first_line(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    # The assertion or exception line: pytest marks it with "E   ".
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[0] if errors else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def pytest_configure(config) -> None:
    path = config.getoption("--vllm-suite-report")
    if path:
        config.pluginmanager.register(Recorder(path), "vllm_suite_recorder")
