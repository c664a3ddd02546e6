"""The `vllm-nvext` command: `serve`, `proxy`, `tiny-model`, `parity`, `sessions`."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from .. import _vllm_compat
from ..capture.store import open_backend
from ..config import ENV_MODE, CaptureApi, ConfigError, Mode, Settings, capture_environ
from ..protocol import COMPLETION_TOKEN_IDS, PATHS, Endpoint
from . import parity, sessions
from .server import MIDDLEWARE, TINY_ARGS, VllmServer
from .sessions import warn_password_in_argv

DEFAULT_PORT = 8000
# `pip install vllm-nvext` brings only orjson: each command names what else it needs.
EXIT_MISSING = 2
VLLM_HOWTO = (
    "install the vLLM build for your hardware (https://docs.vllm.ai/en/latest/getting_started/installation/; "
    "`pip install vllm` on a CUDA machine)"
)
TINY_MODEL_HOWTO = "pip install 'vllm-nvext[tiny-model]' (vLLM brings both)"
PROXY_HOWTO = "pip install 'vllm-nvext[proxy]' (vLLM brings both)"
DEFAULT_PROXY_PORT = 8080
CAPTURE_HELP = (
    "record each request's token ids by session in this store: sqlite:////abs/path.sqlite3 or "
    "redis://host:port/db, its password in $VLLM_NVEXT_CAPTURE_PASSWORD or the file $VLLM_NVEXT_CAPTURE_PASSWORD_FILE "
    "names, never here (a command line is every local user's to read) (default $VLLM_NVEXT_CAPTURE; docs/capture.md)"
)
CAPTURE_API_HELP = (
    "who the read API /v1/nvext/sessions/{id} is served to: keyed (only behind the server's API key: a server without "
    "one does not serve it), open (also without a key: anyone who reaches the server), off (never; read the store "
    "with `vllm-nvext sessions export`) (default $VLLM_NVEXT_CAPTURE_API or keyed; docs/capture.md)"
)
PLUGIN = "nvext"
# Plugins that load without VLLM_PLUGINS but act only when it names them (remote LoRA downloads).
NAMED_ONLY = frozenset({"lora_hf_hub_resolver"})
# vLLM's plugin groups that load every plugin while VLLM_PLUGINS is unset (its endpoint group loads
# only the plugins it names): naming nvext there must not leave the others out.
LOAD_ALL_GROUPS = (
    "vllm.general_plugins",
    "vllm.platform_plugins",
    "vllm.io_processor_plugins",
    "vllm.stat_logger_plugins",
)


CONTINUE_IDS_HELP = (
    "a captured session's next prompt continues its last turn's exact ids (needs --capture; default "
    "$VLLM_NVEXT_CONTINUE_IDS; docs/capture.md)"
)
CONTINUE_IDS_IN_PROXY = (
    "VLLM_NVEXT_CONTINUE_IDS=1 works only mounted in vLLM's server (`vllm-nvext serve --continue-ids`, "
    "--middleware or the plugin): the proxy cannot reach vLLM's chat rendering out of process (docs/capture.md)"
)


def missing_modules(*modules: str) -> list[str]:
    """Which of `modules` cannot be imported here (looked up without importing them)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def _needs(command: str, modules: Sequence[str], what: str, howto: str) -> bool:
    """Print one line naming what is missing and how to get it; True when something is."""
    absent = missing_modules(*modules)
    if absent:
        print(
            f"vllm-nvext {command}: error: needs {what} ({', '.join(absent)} not installed): {howto}", file=sys.stderr
        )
    return bool(absent)


def plugins_with_nvext(current: str | None) -> str:
    """`serve`'s VLLM_PLUGINS: naming nvext, so the endpoint plugin mounts beside `--middleware` (the
    plugin alone serves /v1/messages with ids), and every plugin that would load without it."""
    if current is not None:
        return current if PLUGIN in current.split(",") else f"{current},{PLUGIN}"
    found = {ep.name for group in LOAD_ALL_GROUPS for ep in importlib.metadata.entry_points(group=group)}
    return ",".join(sorted((found - NAMED_ONLY) | {PLUGIN}))


def _banner(base: str, model_name: str, mode: str) -> str:
    vllm_req = {"model": model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    nvext_req = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "nvext": {"extra_fields": [COMPLETION_TOKEN_IDS]},
    }
    lines = [
        f"vllm-nvext: serving on {base} (mode {mode})",
        "  vLLM dialect:",
        f"    curl -s {base}{PATHS[Endpoint.COMPLETIONS]} -H 'Content-Type: application/json' \\\n"
        f"      -d {shlex.quote(json.dumps(vllm_req))}",
        "  Dynamo nvext dialect:",
        f"    curl -s {base}{PATHS[Endpoint.CHAT]} -H 'Content-Type: application/json' \\\n"
        f"      -d {shlex.quote(json.dumps(nvext_req))}",
    ]
    return "\n".join(lines)


def cmd_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    tiny = args.model is None
    rust = _vllm_compat.rust_frontend_on()
    if rust is not None:
        # vLLM's Rust frontend refuses --middleware with no word of vllm-nvext: say why, and what works.
        print(
            f"vllm-nvext serve: error: VLLM_USE_RUST_FRONTEND={rust} serves HTTP with vLLM's Rust frontend, "
            "which cannot mount vllm-nvext; unset it, or serve vLLM with it and run "
            "`vllm-nvext proxy --upstream http://HOST:PORT` in front (docs/scaling-out.md, Out of process)",
            file=sys.stderr,
        )
        return EXIT_MISSING
    if _needs("serve", ["vllm"], "vLLM", VLLM_HOWTO):
        return EXIT_MISSING
    if tiny and _needs(
        "serve", ["torch", "transformers"], "torch and transformers for the tiny model", TINY_MODEL_HOWTO
    ):
        return EXIT_MISSING
    if tiny:
        from . import tiny_model

        model = str(tiny_model.ensure())
    else:
        model = args.model
    mode = Mode.parse(args.mode).value
    capture = _capture_settings("serve", args.capture, args.capture_api, continue_ids=args.continue_ids or None)
    if capture is None:
        return EXIT_MISSING
    server = VllmServer(
        model=model,
        args=(*((*TINY_ARGS, "--served-model-name", "tiny") if tiny else ()), "--middleware", MIDDLEWARE, *extra),
        # Both mounts (docs/agents.md): the inner one stands aside where the outer serves.
        env={
            ENV_MODE: mode,
            "VLLM_PLUGINS": plugins_with_nvext(os.environ.get("VLLM_PLUGINS")),
            **capture_environ(capture),
        },
        host=args.host,
        port=args.port,
        log_to_terminal=True,
    )
    print("vllm-nvext: starting", " ".join(shlex.quote(c) for c in server.command()), flush=True)
    server.start()
    assert server.proc is not None

    def _forward(_signum: int, _frame: object) -> None:
        server.terminate()  # vLLM runs in its own process group: stop all of it

    signal.signal(signal.SIGINT, _forward)
    signal.signal(signal.SIGTERM, _forward)
    try:
        server.wait_ready(args.startup_timeout)
    except RuntimeError:  # exited during start-up; its output is already on the terminal
        return server.proc.wait()
    except TimeoutError:
        pass  # still starting: keep serving it, without the banner
    else:
        served = (
            "tiny"
            if tiny
            else next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--served-model-name"), model)
        )
        print(_banner(server.url, served, mode), flush=True)
    return server.proc.wait()


def cmd_proxy(args: argparse.Namespace) -> int:
    if _needs("proxy", ["aiohttp", "uvicorn"], "aiohttp and uvicorn", PROXY_HOWTO):
        return EXIT_MISSING
    from .. import proxy

    try:
        settings = Settings.create(mode=args.mode, capture=args.capture, capture_api=args.capture_api)
        warn_password_in_argv("proxy", args.capture)
        if settings.continue_ids:
            raise ConfigError(CONTINUE_IDS_IN_PROXY)
        if settings.capture is not None:
            open_backend(settings.capture).close()  # a store it cannot open stops it here, not in each worker
        config = proxy.ProxyConfig(
            upstream=args.upstream,
            api_keys=tuple(args.api_key or [os.environ.get("VLLM_API_KEY", "")]),
            timeout=args.timeout or None,
            reasoning_parser=args.reasoning_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            kv_transfer_config=json.loads(args.kv_transfer_config) if args.kv_transfer_config else None,
            forwarded_allow_ips=tuple(args.forwarded_allow_ips.split(",")),
        )
    except (ConfigError, ValueError) as exc:  # a bad --kv-transfer-config is a JSONDecodeError, a ValueError
        print(f"vllm-nvext proxy: error: {exc}", file=sys.stderr)
        return EXIT_MISSING
    warning = key_mismatch(config)
    if warning:
        print(f"vllm-nvext proxy: warning: {warning}", file=sys.stderr, flush=True)
    print(
        f"vllm-nvext: proxy on http://{args.host}:{args.port} in front of {config.upstream} "
        f"(mode {settings.mode.value}, {args.workers} worker{'s' if args.workers > 1 else ''})",
        flush=True,
    )
    proxy.serve(config, settings, host=args.host, port=args.port, workers=args.workers)
    return 0


def _models_status(upstream: str, key: str | None) -> int | None:
    """The upstream's status for GET /v1/models (with `key` as a bearer token); None: no answer."""
    request = urllib.request.Request(upstream + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def key_mismatch(config: Any) -> str | None:
    """What is wrong with the proxy's --api-key for its upstream, asked at start-up (a keyless GET /v1/models:
    401 when the upstream checks a key); None when they agree, or the upstream does not answer."""
    keyless = _models_status(config.upstream, None)
    if keyless is None or keyless not in (200, 401):
        return None
    if keyless == 200 and config.api_keys:
        return (
            "the upstream answers /v1 without a key, but the proxy has --api-key: requests without the proxy's "
            "key reach the upstream untranslated (no ids); give the proxy the upstream's key, or none"
        )
    if keyless == 401 and not config.api_keys:
        return (
            "the upstream checks an API key and the proxy has none (--api-key or VLLM_API_KEY): a keyless "
            "request may get the proxy's 400 before the upstream's 401; give the proxy the upstream's key"
        )
    if keyless == 401 and _models_status(config.upstream, config.api_keys[0]) == 401:
        return (
            "the upstream refuses the proxy's --api-key: requests with the proxy's key get the upstream's 401, "
            "and requests with the upstream's key reach it untranslated (no ids); give the proxy the upstream's key"
        )
    return None


def _capture_settings(
    command: str, url: str | None, capture_api: str | None, continue_ids: bool | None = None
) -> Settings | None:
    """The capture settings of `--capture URL` (else the environment's), the store opened once to check it."""
    warn_password_in_argv(command, url)
    try:
        settings = Settings.create(capture=url, capture_api=capture_api, continue_ids=continue_ids)
        if settings.capture is not None:
            open_backend(settings.capture).close()
    except ConfigError as exc:
        print(f"vllm-nvext {command}: error: {exc}", file=sys.stderr)
        return None
    return settings


def cmd_tiny_model(args: argparse.Namespace) -> int:
    if _needs("tiny-model", ["torch", "transformers"], "torch and transformers", TINY_MODEL_HOWTO):
        return EXIT_MISSING
    from . import tiny_model

    path = tiny_model.write(args.dir)
    print(path)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-nvext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run a vLLM OpenAI server with the middleware mounted",
        description="Run vLLM's OpenAI server with vllm-nvext mounted. Arguments after `--` go to `vllm serve`.",
    )
    serve.add_argument("--model", help="model directory or name (default: the embedded tiny model)")
    serve.add_argument("--mode", default=os.environ.get(ENV_MODE, "auto"), choices=[m.value for m in Mode])
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--startup-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    serve.add_argument("--capture", default=None, metavar="URL", help=CAPTURE_HELP)
    serve.add_argument("--continue-ids", action="store_true", help=CONTINUE_IDS_HELP)
    serve.add_argument("--capture-api", default=None, choices=[a.value for a in CaptureApi], help=CAPTURE_API_HELP)

    prox = sub.add_parser(
        "proxy",
        help="translate in a proxy in front of any vLLM OpenAI server (Rust frontend, router, stock image)",
        description="Serve vllm-nvext's translation out of process: every request goes to --upstream, "
        "the token endpoints translated as the mounted middleware translates them.",
    )
    prox.add_argument("--upstream", required=True, help="the vLLM server (or router) URL, e.g. http://127.0.0.1:8000")
    prox.add_argument("--host", default="127.0.0.1")
    prox.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT)
    prox.add_argument("--mode", default=None, choices=[m.value for m in Mode], help="default: $VLLM_NVEXT_MODE or auto")
    prox.add_argument("--workers", type=_positive, default=1, help="proxy processes (default 1)")
    prox.add_argument("--capture", default=None, metavar="URL", help=CAPTURE_HELP)
    prox.add_argument("--capture-api", default=None, choices=[a.value for a in CaptureApi], help=CAPTURE_API_HELP)
    prox.add_argument(
        "--api-key",
        action="append",
        help="the upstream's --api-key (repeat for several; default $VLLM_API_KEY): requests it would refuse "
        "are never answered by the proxy, only forwarded",
    )
    prox.add_argument(
        "--forwarded-allow-ips",
        default=os.environ.get("FORWARDED_ALLOW_IPS", ""),
        help="comma-separated addresses or networks (or *) of the proxies in front of this one, whose "
        "X-Forwarded-* headers are kept and appended to (default $FORWARDED_ALLOW_IPS, else none: every "
        "client's are replaced by its own address)",
    )
    prox.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for each read from the upstream before a 504 (0: no limit; default 600)",
    )

    upstream_flags = prox.add_argument_group(
        "the upstream's own vllm serve flags",
        "repeat those the middleware reads from vLLM's arguments when mounted (docs/scaling-out.md)",
    )
    upstream_flags.add_argument("--reasoning-parser", default=None)
    upstream_flags.add_argument("--enable-auto-tool-choice", action="store_true")
    upstream_flags.add_argument("--tool-call-parser", default=None)
    upstream_flags.add_argument("--kv-transfer-config", default=None, help="its JSON")

    tiny = sub.add_parser("tiny-model", help="write the deterministic tiny model into DIR")
    tiny.add_argument("dir")

    parity.add_arguments(sub.add_parser("parity", help="A/B-check both dialects against a running server"))
    sessions.add_arguments(sub.add_parser("sessions", help="read the capture store (docs/capture.md)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args, extra)
    if args.command == "proxy":
        return cmd_proxy(args)
    if args.command == "tiny-model":
        return cmd_tiny_model(args)
    if args.command == "sessions":
        return sessions.run(args)
    return parity.run(args)


if __name__ == "__main__":
    sys.exit(main())
