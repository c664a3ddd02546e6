"""vllm-nvext: one `vllm serve` that speaks both vLLM's `return_token_ids` and Dynamo's `nvext`."""

from .config import ConfigError, Mode, Settings
from .middleware import NvextMiddleware

__all__ = ["ConfigError", "Mode", "NvextMiddleware", "Settings", "__version__"]
__version__ = "0.1.0"
