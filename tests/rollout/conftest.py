"""Fixtures for the rollout tests: one real stock `vllm serve` of the tiny model per test module."""

from __future__ import annotations

import socket

import pytest

from vllm_ainfer_pd.models.generate import ensure_model
from vllm_ainfer_pd.rollout.cpu_engine import CPU_ENGINE_ARGS, cpu_env, serve_args
from vllm_ainfer_pd.rollout.server import VllmServer


@pytest.fixture(scope="module")
def tiny_server():
    """A stock server of the tiny model (max_model_len 2048), shared by the module's tests; its
    log tail is printed when a test of the module failed. It starts while another socket holds
    the port it picked first, as when another process takes that port before the server binds
    it: `taken_port` is that port, and the server runs on another."""
    srv = VllmServer(ensure_model("tiny"), serve_args(CPU_ENGINE_ARGS), cpu_env(1),
                     name="rollout-test")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", srv.port))
        holder.listen()
        srv.taken_port = srv.port
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def dead_url() -> str:
    """A URL on which nothing listens (a port just freed)."""
    from vllm_ainfer_pd.rollout.server import free_port

    return f"http://127.0.0.1:{free_port()}"
