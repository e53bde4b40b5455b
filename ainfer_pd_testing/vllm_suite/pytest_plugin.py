"""pytest plugin of a vLLM suite run (`-p ainfer_pd_testing.vllm_suite.pytest_plugin`): writes
each test's outcome, duration, first error line, the engine args it built, the engine steps and
the P-lane jobs it ran to `--vllm-suite-report` (JSON), read by `benchmarks/vllm_tests.py`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ainfer_pd_testing.vllm_suite import LOG_ENV


def pytest_addoption(parser) -> None:
    parser.addoption("--vllm-suite-report", default=None, help="JSON file of per-test results")


def _events_path() -> Path | None:
    folder = os.environ.get(LOG_ENV)
    return Path(folder, "events.log") if folder else None


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[str, dict] = {}
        self._offset = 0  # bytes of the event log already counted

    def _counts_since_last(self) -> tuple[int, int, int]:
        """(engine args built, engine steps with tokens, P-lane jobs) logged since the last test
        ended; what ran
        between tests (a module fixture's engine warming up) goes to the next test."""
        path = _events_path()
        if path is None or not path.exists():
            return 0, 0, 0
        with open(path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is counted next time
        self._offset += len(complete)
        new = complete.decode().splitlines()
        return (sum(1 for e in new if e.startswith("engine ")),
                sum(1 for e in new if e.startswith("step ")),
                sum(1 for e in new if e.startswith("pjob ")))

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.results.setdefault(
            report.nodeid, {"outcome": "passed", "duration": 0.0, "message": "", "engines": 0,
                           "steps": 0, "lane_jobs": 0})
        entry["duration"] += report.duration
        if report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["message"] = _first_line(report)
        elif report.failed:
            # A failure in setup or teardown (an engine that did not start) is a failure too.
            entry["outcome"] = "failed"
            entry["message"] = entry["message"] or f"{report.when}: {_first_line(report)}"
        if report.when == "teardown":
            engines, steps, jobs = self._counts_since_last()
            entry["engines"] += engines
            entry["steps"] += steps
            entry["lane_jobs"] += jobs
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
