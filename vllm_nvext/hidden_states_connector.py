"""The connector's first import path, kept for `kv_connector_module_path` values that name it:
the connector lives in `vllm_nvext.connectors.hidden_states`."""

from .connectors.hidden_states import CPUHiddenStatesConnector

__all__ = ["CPUHiddenStatesConnector"]
