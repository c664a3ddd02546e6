"""The proxy's configuration: where the upstream is, how long to wait for it, and what it checks.

`ProxyConfig` is validated once, in the command, and handed to each uvicorn worker as JSON
(`ENV_CONFIG`), so a bad value is refused before any worker starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from .headers import trusted_networks

# The proxy's settings for the worker processes uvicorn spawns (JSON of ProxyConfig).
ENV_CONFIG = "VLLM_NVEXT_PROXY_CONFIG"
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProxyConfig:
    """Where the upstream is, how long to wait for it, and the keys its `--api-key` check takes."""

    upstream: str
    api_keys: tuple[str, ...] = ()
    # Seconds to wait for each read from (or write to) the upstream; None: no limit.
    timeout: float | None = DEFAULT_TIMEOUT_S
    connect_timeout: float = CONNECT_TIMEOUT_S
    # The upstream's own `vllm serve` flags the middleware reads from vLLM's args when mounted:
    # a parser makes vLLM withhold ids under `include_reasoning: false`; a kv connector may name
    # files after request ids (`_vllm_compat.hides_reasoning_ids`, `builds_paths_from_request_ids`).
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    kv_transfer_config: dict[str, Any] | None = None
    # The peers whose X-Forwarded-* / Forwarded headers are kept (addresses, networks, or "*").
    forwarded_allow_ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        url = urlsplit(self.upstream)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"upstream: expected an http:// or https:// URL, got {self.upstream!r}")
        object.__setattr__(self, "upstream", self.upstream.rstrip("/"))
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))
        allowed = tuple(a.strip() for a in self.forwarded_allow_ips if a.strip())
        object.__setattr__(self, "forwarded_allow_ips", allowed)
        trusted_networks(allowed)  # refuses a bad entry here, in the command, not in each worker

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        raw = json.loads(text)
        tuples = {k: tuple(raw.get(k, ())) for k in ("api_keys", "forwarded_allow_ips")}
        return cls(**{**raw, **tuples})
