"""The vLLM plugins: `VLLM_PLUGINS=nvext vllm serve MODEL` mounts the middleware.

The endpoint plugin: vLLM calls `attach_router` on the app before its own auth and CORS
middleware are added, so this mount sits inside them (unlike `--middleware`, which is outermost).

The general plugin of the same name, `refuse_rust_frontend`, runs in every vLLM Python process,
the `vllm serve` command's own included (it loads general plugins while building its argument
parser), also when vLLM's Rust frontend serves HTTP and no endpoint plugin is ever loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import _vllm_compat
from .agent.messages import PLUGIN_STATE
from .config import Settings
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


RUST_FRONTEND_REFUSAL = (
    "vllm-nvext: VLLM_PLUGINS names nvext, but VLLM_USE_RUST_FRONTEND={value} serves HTTP with vLLM's Rust "
    "frontend, which loads no endpoint plugin and no --middleware: the server would answer without vllm-nvext, "
    "silently. Unset VLLM_USE_RUST_FRONTEND, or serve without nvext in VLLM_PLUGINS and run "
    "`vllm-nvext proxy --upstream http://HOST:PORT` in front of it (docs/scaling-out.md, Out of process)."
)


def refuse_rust_frontend(environ: Mapping[str, str] | None = None) -> None:
    """vLLM's general plugin `nvext`: stop a server configured for vllm-nvext under the Rust frontend."""
    env = os.environ if environ is None else environ
    value = _vllm_compat.rust_frontend_on(env)
    plugins = env.get("VLLM_PLUGINS")
    if value is not None and plugins is not None and "nvext" in plugins.split(","):
        raise SystemExit(RUST_FRONTEND_REFUSAL.format(value=value))
