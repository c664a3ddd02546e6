"""The connector's first import path, kept for `kv_connector_module_path` values that name it:
the connector lives in `vllm_nvext.connectors.pd`."""

from .connectors.pd import CPUPDConnector

__all__ = ["CPUPDConnector"]
