"""A worker extension that records, per rank, every decision of the lane's epoch gate: the rows
of vLLM's DP all-reduce the gate read (each DP rank's queued lane tokens and decode rows), the
rounds the oldest queued work has waited, and whether the round met to open an epoch.

`vllm serve ... --worker-extension-cls ainfer_pd_testing.gate_log.GateLog` with
`dev_server.SERVER_ENV`, then, while the server is idle (no rank has stepped since the last
request, so every rank's log starts at the same round): `POST /collective_rpc` with
`{"method": "start_gate_log", "kwargs": {"prefix": ...}}`. Each rank appends one line per
decision with lane work queued on some rank to `<prefix>.<world rank>`; the collective log's
`read_logs` and `first_divergence` read and compare them. Every rank must write the same lines:
a rank that decided alone would meet a rendezvous its peers skip (or skip one they meet).
"""

from __future__ import annotations


class GateLog:
    """Mixed into the engine's worker class by vLLM (`worker_extension_cls`)."""

    def start_gate_log(self, prefix: str) -> dict | None:
        from vllm_ainfer_pd.vllm_glue import dp_sync

        lane = self.p_lane  # `self` is the AInferPDWorker this class is mixed into
        if lane is None:
            return None
        out = open(f"{prefix}.{lane.rank}", "a", buffering=1)  # noqa: SIM115 - lives with the lane
        decide = lane._gate_opens

        def recorded() -> bool:
            opens = decide()
            rows = dp_sync.lane_rows()
            if rows is not None and any(rows[0]):
                queued, decoding = rows
                out.write(f"queued={queued} decoding={decoding} waited={lane.waited_rounds} "
                          f"opens={opens}\n")
            return opens

        lane._gate_opens = recorded
        return {"rank": lane.rank}

