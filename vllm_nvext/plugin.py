"""The vLLM endpoint plugin: `VLLM_PLUGINS=nvext vllm serve MODEL` mounts the middleware.

vLLM calls `attach_router` on the app before its own auth and CORS middleware are added, so
this mount sits inside them (unlike `--middleware`, which is outermost).
"""

from __future__ import annotations

from typing import Any

from .config import Settings
from .messages_api import PLUGIN_STATE
from .middleware import NvextMiddleware


class NvextPlugin:
    name = "nvext"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        # Validated now: an invalid VLLM_NVEXT_* value stops the server from starting.
        app.add_middleware(NvextMiddleware, settings=Settings.from_env(), serve_messages=True)
        # A --middleware mount outside leaves /v1/messages to this one (docs/protocol.md §11.2).
        setattr(app.state, PLUGIN_STATE, True)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        return None
