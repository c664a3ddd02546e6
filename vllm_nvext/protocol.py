"""The vocabulary both dialects share: endpoints, response selectors, and the error the middleware answers.

Pure data; see docs/protocol.md for what each name means on the wire.
"""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Callable
from contextvars import ContextVar

from . import _json


class Endpoint(str, enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    # One chat.completion answering several conversations, one choice each (vLLM 0.32+).
    CHAT_BATCH = "chat_batch"
    # SageMaker's route: vLLM serves the body as chat when its chat model validates it, else as completions.
    INVOCATIONS = "invocations"


class Dialect(str, enum.Enum):
    """What a request that reached vLLM asked in (the metrics' `dialect` label, docs/metrics.md)."""

    VLLM = "vllm"  # `return_token_ids: true` alone
    NVEXT = "nvext"  # `nvext` without `return_token_ids: true`
    BOTH = "both"  # both opt-ins in one body
    NONE = "none"  # opted into nothing, or not read (passed through)


class Placement(str, enum.Enum):
    """Where a response carries the ids (docs/protocol.md §1, §3.4): vLLM's own fields, or under `nvext`."""

    VLLM = "vllm"
    NVEXT = "nvext"


# The routes the middleware reads, relative to vLLM's root path; every other route passes byte for
# byte (docs/protocol.md §10 lists what each of vLLM's routes gets).
ENDPOINT_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/chat/completions/batch": Endpoint.CHAT_BATCH,
    "/invocations": Endpoint.INVOCATIONS,
}
# Routes translated nowhere that the middleware still reads, for the client values that reach further
# than the request (inbound/client_params.py): where vLLM makes the engine's request id of the body's
# `request_id` (without an X-Request-Id: docs/hidden-states.md) ...
REQUEST_ID_PATHS = frozenset({"/inference/v1/generate", "/generative_scoring", "/v1/systemone"})
# ... and where it hands the body's `kv_transfer_params` to the kv connector (docs/scaling-out.md).
KV_PARAMS_PATHS = frozenset({"/inference/v1/generate", "/cohere/v2/chat"})
# Where vLLM takes the body's `request_id` even with an X-Request-Id.
BODY_REQUEST_ID_PATHS = frozenset({"/v1/responses"})
# The same table the other way round: each endpoint's path (what the tools and tests send to).
PATHS = {endpoint: path for path, endpoint in ENDPOINT_PATHS.items()}

# Response selectors Dynamo understands (docs/protocol.md §3.2); other strings are ignored, as Dynamo does.
COMPLETION_TOKEN_IDS = "completion_token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
ENGINE_DATA = "engine_data"
TIMING = "timing"
STOP_REASON = "stop_reason"
DETAILED_FINISH_REASON = "detailed_finish_reason"
PROMPT_LOGPROBS = "prompt_logprobs"
ROUTED_EXPERTS = "routed_experts"
# Dynamo's, never answered here: a single vLLM server has no Dynamo workers (docs/protocol.md §5).
WORKER_ID = "worker_id"
ID_SELECTORS = frozenset({COMPLETION_TOKEN_IDS, PROMPT_TOKEN_IDS})
# Selectors answered under `nvext` in every mode: vLLM has no place for them.
NVEXT_ONLY_SELECTORS = frozenset(
    {ENGINE_DATA, TIMING, STOP_REASON, DETAILED_FINISH_REASON, PROMPT_LOGPROBS, ROUTED_EXPERTS}
)
# Dynamo 1.6.1 refuses n > 1 (and a completions batch) only for the nvext-placed trio; every
# other selector is answered per choice. Selectors that describe one prompt are refused on a
# completions batch: Dynamo documents them as single-prompt (1.6.1 answers the last prompt's ids).
SINGLE_PROMPT_SELECTORS = (PROMPT_TOKEN_IDS, ENGINE_DATA, PROMPT_LOGPROBS)


class RequestError(Exception):
    """A request the middleware refuses; rendered in vLLM's error envelope."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


# The envelope's `type` by status: vLLM's names, and the proxy's own for an unreachable or late upstream.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "Method Not Allowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    502: "BadGatewayError",
    503: "Service Unavailable",
    504: "GatewayTimeoutError",
}


def error_body(message: str, param: str | None, status: int) -> bytes:
    """vLLM's error envelope (docs/protocol.md §9), the message passed through vLLM's `sanitize_message`."""
    kind = _ERROR_TYPES.get(status, "BadRequestError")
    return _json.dumps({"error": {"message": sanitize_message(message), "type": kind, "param": param, "code": status}})


# vLLM's own sanitizer (0.32+), used when its serving code is loaded; else this copy of its rules, as the
# release whose rules apply has them: each release's `sanitize_message` (tests/e2e/test_versions.py compares).
_VLLM_SANITIZER = "vllm.entrypoints.serve.exception_handling.utils"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
# vLLM 0.30 rewrites lower-case hex addresses only (0.31 on: either case; 0.34's rewritten path rule gives
# the same answers as this one).
_ADDRESS_BY_RELEASE = {"0.30": re.compile(r" at 0x[0-9a-f]+>")}
_LEAKS = (
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)
_RELEASE = re.compile(r"(\d+\.\d+)")
# The vLLM release whose rules sanitize this request's messages when it is not the one in this process:
# `vllm-nvext proxy` sets its upstream's (read from its /version) for each request it serves.
UPSTREAM_RELEASE: ContextVar[str | None] = ContextVar("vllm_nvext_upstream_release", default=None)


def _pinned_sanitize(message: str, release: str | None = None) -> str:
    """`release`'s rules (a version string, e.g. "0.30.0+cpu"; None: the newest)."""
    found = _RELEASE.match(release or "")
    address = _ADDRESS_BY_RELEASE.get(found.group(1), _ADDRESS) if found else _ADDRESS
    message = address.sub(">", message)
    for pattern, replacement in _LEAKS:
        message = pattern.sub(replacement, message)
    return message.strip()


def sanitize_message(message: str) -> str:
    """Strip memory addresses, tracebacks and file paths from a message, as vLLM does with its own (the
    upstream's release's rules through the proxy)."""
    upstream = UPSTREAM_RELEASE.get()
    if upstream is not None:
        return _pinned_sanitize(message, upstream)
    theirs: Callable[[str], str] | None = getattr(sys.modules.get(_VLLM_SANITIZER), "sanitize_message", None)
    return (theirs or _pinned_sanitize)(message)
