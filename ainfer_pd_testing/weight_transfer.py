"""vLLM's native weight transfer (`WeightTransferConfig`, `init_weight_transfer_engine`,
`start_weight_update` / `update_weights` / `finish_weight_update`) with a transport that runs on
the CPU, for tests.

vLLM 0.26 registers three transports and all need CUDA: `nccl` and `sparse_nccl` broadcast over a
`PyNcclCommunicator`, `ipc` rebuilds CUDA IPC handles (`torch.cuda.get_device_properties`,
`rebuild_cuda_tensor`). `tcp_store` here is `nccl`'s protocol with the tensors carried by the
`StatelessProcessGroup` vLLM already builds under its NCCL group (a TCP store): the same init
info (trainer = rank 0, each worker at `rank_offset` + its global rank), the same update info
(names, dtypes, shapes), and the same layerwise reload around `model.load_weights`, so the worker
side of vLLM's lifecycle runs as it does with `nccl`.

Registering a transport is vLLM's extension point (`WeightTransferEngineFactory.register_engine`);
it must happen in the worker process, so importing this module registers it, and the worker
imports it through `worker_extension_cls=EXTENSION`:

    LLM(model, weight_transfer_config={"backend": "tcp_store"}, worker_extension_cls=EXTENSION)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from ainfer_pd_testing.weight_update import Weights, WeightUpdate

BACKEND = "tcp_store"
EXTENSION = "ainfer_pd_testing.weight_transfer.TransferExtension"


@dataclass
class TCPStoreInitInfo(WeightTransferInitInfo):
    """`nccl`'s init info, plus a bound on every wait for the trainer."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: int = 120


class TCPStoreWeightTransferEngine(
    WeightTransferEngine[TCPStoreInitInfo, NCCLWeightTransferUpdateInfo]
):
    """The worker's end: rank `rank_offset + dp_rank * world_size + rank` of the group."""

    init_info_cls = TCPStoreInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: TCPStoreInitInfo) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        parallel = self.parallel_config
        rank = (parallel.data_parallel_index * parallel.world_size + parallel.rank
                + init_info.rank_offset)
        self.group = StatelessProcessGroup.create(
            host=init_info.master_address, port=init_info.master_port, rank=rank,
            world_size=init_info.world_size, store_timeout=init_info.timeout_s)

    def start_weight_update(self) -> None:
        # Checkpoint-format weights, as `nccl` and `ipc` receive them.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # vLLM's version ends with `torch.accelerator.synchronize()`, which raises where there is
        # no accelerator; the store's tensors are on the host, so nothing is left to wait for.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("tcp_store weight transfer not initialized: call "
                               "init_weight_transfer_engine first")
        for name, dtype, shape in zip(update_info.names, update_info.dtype_names,
                                      update_info.shapes):
            tensor = self.group.broadcast(None, src=0)
            if str(tensor.dtype).split(".")[-1] != dtype or list(tensor.shape) != list(shape):
                raise ValueError(f"{name}: got {tensor.dtype} {list(tensor.shape)}, the update "
                                 f"announced {dtype} {shape}")
            self.model.load_weights([(name, tensor.to(self.device))])

    def shutdown(self) -> None:
        self.group = None

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]],
                             trainer_args: dict) -> None:
        """`trainer_args={"group": <the trainer's StatelessProcessGroup>}`."""
        for _, tensor in iterator:
            trainer_args["group"].broadcast(tensor.detach().contiguous().cpu(), src=0)


try:
    WeightTransferEngineFactory.register_engine(BACKEND, TCPStoreWeightTransferEngine)
except ValueError:  # "already registered": the module was imported again in this process
    pass


class TransferExtension(WeightUpdate):
    """The worker extension whose import registers `tcp_store` in vLLM's worker processes; the
    harness's `perturb_weights` stays available."""


class Trainer:
    """The trainer's end of `tcp_store`: rank 0 of a group with `num_workers` inference ranks
    (several engines may join it at different `rank_offset`s)."""

    def __init__(self, num_workers: int, timeout_s: int = 120):
        self.world_size = num_workers + 1
        # The store's port is bound here and held until `connect`: a port only looked up now
        # and bound later can be taken meanwhile by an engine starting (a DP server binds many
        # ephemeral ports), and the workers would then wait on the wrong listener.
        self.listen_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listen_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listen_socket.bind(("127.0.0.1", 0))
        self.listen_socket.listen()
        self.port = self.listen_socket.getsockname()[1]
        self.timeout_s = timeout_s
        self.group = None

    def init_info(self, rank_offset: int = 1) -> dict:
        """What `init_weight_transfer_engine(WeightTransferInitRequest(init_info=...))` takes."""
        return {"master_address": "127.0.0.1", "master_port": self.port,
                "rank_offset": rank_offset, "world_size": self.world_size,
                "timeout_s": self.timeout_s}

    def connect(self) -> None:
        """Open the group; returns once every worker has joined (call it beside the engines'
        `init_weight_transfer_engine`, as with `nccl`)."""
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(
            host="127.0.0.1", port=self.port, rank=0, world_size=self.world_size,
            store_timeout=self.timeout_s, listen_socket=self.listen_socket)

    @staticmethod
    def update_info(weights: Weights) -> dict:
        """What `update_weights(WeightTransferUpdateRequest(update_info=...))` takes."""
        return {"names": [name for name, _ in weights],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in weights],
                "shapes": [list(t.shape) for _, t in weights]}

    def send(self, weights: Weights) -> None:
        TCPStoreWeightTransferEngine.trainer_send_weights(iter(weights), {"group": self.group})
