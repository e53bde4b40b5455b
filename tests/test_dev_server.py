"""The harness's one client of vLLM's development endpoints, against a stub server: what
`collective_rpc` posts and returns, and `admin`'s query string and method."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ainfer_pd_testing.dev_server import admin, collective_rpc


@pytest.fixture
def stub():
    """A server answering every request with what it received: {"method", "path", "body"}."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            got = {"method": self.command, "path": self.path,
                   "body": json.loads(raw) if raw else None}
            seen.append(got)
            answer = {"results": [got, got]} if self.path == "/collective_rpc" else got
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_collective_rpc_posts_the_method_and_its_kwargs_and_returns_the_results(stub):
    url, seen = stub
    results = collective_rpc(url, "inject_p_faults", stall="1:3", slow_boundary_s=0.1)
    assert len(results) == 2
    assert seen == [{"method": "POST", "path": "/collective_rpc",
                     "body": {"method": "inject_p_faults",
                              "kwargs": {"stall": "1:3", "slow_boundary_s": 0.1}}}]


def test_admin_sends_params_as_the_query_and_get_without_a_body(stub):
    url, seen = stub
    assert admin(url, "/pause", mode="keep", clear_cache="false")["path"] == \
        "/pause?mode=keep&clear_cache=false"
    assert admin(url, "/is_paused", method="GET") == {"method": "GET", "path": "/is_paused",
                                                      "body": None}
    assert seen[0]["method"] == "POST"
