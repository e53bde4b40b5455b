"""Diagnosis switches for the P lane on the GPU, loaded as a second vLLM general plugin.

Not part of the package: on the lent GPU machine the project is put on PYTHONPATH with a small
dist-info whose entry_points.txt may also name `ainfer_pd_gpu_diag = benchmarks.gpu_lane_diag:register`.
It changes nothing unless its environment variable is set:

AINFER_PD_DIAG_P_WORKSPACE=1
    Give the P thread its own vLLM `WorkspaceManager`. vLLM 0.26's fused-MoE modular kernel takes
    its scratch buffers (workspace13/workspace2/output) from one process-global workspace
    (`vllm.v1.worker.workspace._manager`, one slot per DBO micro-batch, slot 0 outside DBO). P's
    eager MoE on the P stream and D's compiled/graph-replayed MoE on D's stream would otherwise
    write the same device bytes concurrently. The P thread swaps the module global in while it
    runs model code and back at every boundary, as it does with vLLM's forward context.
"""

from __future__ import annotations

import os

ENV_P_WORKSPACE = "AINFER_PD_DIAG_P_WORKSPACE"


def register() -> None:
    if os.environ.get(ENV_P_WORKSPACE) != "1":
        return
    from vllm_ainfer_pd.worker import p_lane

    if getattr(p_lane.PLane, "_diag_p_workspace", False):
        return
    import vllm.v1.worker.workspace as ws

    forward = p_lane.PLane._forward
    boundary = p_lane.PLane._boundary

    def _forward(self, epoch):
        if not self.is_cuda:
            return forward(self, epoch)
        if getattr(self, "_p_workspace", None) is None:
            self._p_workspace = ws.WorkspaceManager(self.runner.device)
        self._d_workspace = ws._manager
        ws._manager = self._p_workspace
        try:
            return forward(self, epoch)
        finally:
            ws._manager = self._d_workspace
            self._d_workspace = None

    def _boundary(self, epoch, b):
        d = getattr(self, "_d_workspace", None)
        if d is None:  # boundary 0, before P's forward: D's workspace is installed
            return boundary(self, epoch, b)
        ws._manager = d
        out = boundary(self, epoch, b)  # P parks here; D runs with its own workspace
        ws._manager = self._p_workspace  # P resumed: the main thread waits
        return out

    p_lane.PLane._forward = _forward
    p_lane.PLane._boundary = _boundary
    p_lane.PLane._diag_p_workspace = True
