"""The P lane in vLLM's KV-connector slot: registration by name, and what the connector and its
metrics rely on beyond `KVConnectorBase_V1`'s documented hooks."""

from __future__ import annotations

from vllm_ainfer_pd.vllm_glue.shapes import Patch

_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1"
PATCHES = [
    Patch(f"{_FACTORY}.register_connector", "`kv_connector: AInferPDConnector` resolves by name "
          "in every process", ("name", "module_path", "class_name"), does="calls"),
    Patch(f"{_FACTORY}._registry", "registration is idempotent (the factory refuses a name "
          "twice, and the plugin runs more than once per process)", does="reads"),
    Patch(_BASE, "the connector reads its options from `kv_connector_extra_config`",
          uses=("_kv_transfer_config",), does="reads"),
    Patch(f"{_BASE}._get_connector_metadata", "the worker role hands this step's jobs and "
          "cancels to the lane in `start_load_kv`", ("self",), does="calls"),
    Patch("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics",
          "the lane's Prometheus counters and gauges are built with vLLM's metric classes and "
          "engine labels", uses=("_counter_cls", "_gauge_cls", "per_engine_labelvalues"),
          does="reads"),
]


def register(name: str, module_path: str, class_name: str) -> None:
    """Register a connector with vLLM's `KVConnectorFactory`; safe to call repeatedly."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)
