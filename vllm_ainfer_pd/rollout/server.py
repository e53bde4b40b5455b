"""Start and stop `vllm serve` on 127.0.0.1: free port, readiness wait, log kept for failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    """The `vllm` console script beside this interpreter (the one users type); where vLLM is only
    on PYTHONPATH (the lent GPU machine), the same CLI through `python -m`."""
    script = Path(sys.executable).with_name("vllm")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class VllmServer:
    """`with VllmServer(model, ["--tensor-parallel-size", "2"], env) as srv: srv.url ...`

    The server runs in its own process group so that stopping it also stops its engine and worker
    processes. `log_tail()` returns the end of its log; errors raised here include it.
    """

    def __init__(self, model: str | Path, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout_s: float = 600.0, name: str = "vllm"):
        self.model = str(model)
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        fd, log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.pick_port()

    def pick_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = vllm_command() + [
            "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> None:
        """Start the server and wait for `/health`. The port was free when picked but is bound
        only once the server process runs; another process that took it meanwhile makes the
        server exit with EADDRINUSE, and then a new port is picked (up to `attempts` starts)."""
        for attempt in range(1, attempts + 1):
            try:
                return self.start_once()
            except ServerError as err:
                if attempt == attempts or "Address already in use" not in str(err):
                    raise
                self.pick_port()

    def start_once(self) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vllm serve exited with {self.proc.returncode} during "
                                  f"start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"vllm serve not ready after {self.startup_timeout_s:.0f} s:\n"
                          f"{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
