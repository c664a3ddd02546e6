"""Compatibility modes and server settings, read from the environment and validated once; and the one bound
on what the server keeps per distinct input (`keep`)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

ENV_MODE = "VLLM_NVEXT_MODE"
ENV_ALLOW_MODE_HEADER = "VLLM_NVEXT_ALLOW_MODE_HEADER"
ENV_MAX_BODY_BYTES = "VLLM_NVEXT_MAX_BODY_BYTES"
ENV_STRIP_KV_REMOTE_ADDRESS = "VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS"
ENV_PURE_PYTHON = "VLLM_NVEXT_PURE_PYTHON"
ENV_CAPTURE = "VLLM_NVEXT_CAPTURE"
ENV_CAPTURE_MAX_BYTES = "VLLM_NVEXT_CAPTURE_MAX_BYTES"
ENV_CAPTURE_RETENTION_S = "VLLM_NVEXT_CAPTURE_RETENTION_S"
ENV_CAPTURE_QUEUE_BYTES = "VLLM_NVEXT_CAPTURE_QUEUE_BYTES"
ENV_CONTINUE_IDS = "VLLM_NVEXT_CONTINUE_IDS"
ENV_CAPTURE_API = "VLLM_NVEXT_CAPTURE_API"
ENV_CAPTURE_BODY_KEYS = "VLLM_NVEXT_CAPTURE_BODY_KEYS"
ENV_CAPTURE_LOGPROBS = "VLLM_NVEXT_CAPTURE_LOGPROBS"
ENV_CAPTURE_PASSWORD = "VLLM_NVEXT_CAPTURE_PASSWORD"
ENV_CAPTURE_PASSWORD_FILE = "VLLM_NVEXT_CAPTURE_PASSWORD_FILE"
MODE_HEADER = "x-nvext-mode"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_CAPTURE_MAX_BYTES = 1024 * 1024 * 1024  # the capture store's size cap (docs/capture.md)
DEFAULT_CAPTURE_RETENTION_S = 7 * 24 * 3600  # how long a captured turn is kept
DEFAULT_CAPTURE_QUEUE_BYTES = 256 * 1024 * 1024  # what the turns waiting for the store's writer may hold
CAPTURE_SCHEMES = ("sqlite://", "redis://", "rediss://")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """An invalid setting; the server refuses to start with it."""


class Mode(str, enum.Enum):
    """Where the token-id trio (completion ids, prompt ids, kv_transfer_params) goes."""

    AUTO = "auto"  # follow the request's dialect
    VLLM = "vllm"  # vLLM placement (docs/protocol.md §6)
    NVEXT = "nvext"  # Dynamo placement with the token-id trio (docs/protocol.md §3.4)
    BOTH = "both"  # both placements in one response

    @classmethod
    def parse(cls, value: str) -> Mode:
        try:
            return cls(value.strip().lower())
        except ValueError:
            choices = "|".join(m.value for m in cls)
            raise ValueError(f"invalid mode {value!r}: expected one of {choices}") from None


class CaptureApi(str, enum.Enum):
    """Who the capture's read API (`/v1/nvext/sessions/{id}`) is served to (docs/capture.md, Threat model)."""

    KEYED = "keyed"  # only where the server checks an API key, under that check (the default)
    OPEN = "open"  # also without a key: anyone who reaches the server reads and deletes every session
    OFF = "off"  # never: the store is read with `vllm-nvext sessions export`


@dataclass(frozen=True, slots=True)
class Settings:
    """The middleware's settings; every way of making them is validated by the same rules.

    `from_env` reads VLLM_NVEXT_*; `create` takes keyword arguments (what
    `NvextMiddleware(app, mode=..., ...)` passes); a direct `Settings(...)` is checked too.
    A bad value raises ConfigError naming the variable or keyword.
    """

    mode: Mode = Mode.AUTO
    allow_mode_header: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Remove `remote_host` / `remote_port` from a client's kv_transfer_params (docs/scaling-out.md).
    strip_kv_remote_address: bool = False
    pure_python: bool = False  # the pure-Python stream path even where the compiled one is built
    # The capture store's URL (docs/capture.md); None: nothing is recorded.
    capture: str | None = None
    capture_max_bytes: int = DEFAULT_CAPTURE_MAX_BYTES
    capture_retention_s: int = DEFAULT_CAPTURE_RETENTION_S
    capture_queue_bytes: int = DEFAULT_CAPTURE_QUEUE_BYTES
    # A captured session's next prompt continues its last turn's ids (docs/capture.md); needs capture.
    continue_ids: bool = False
    capture_api: CaptureApi = CaptureApi.KEYED  # who the read API is served to
    # A body's `prompt_cache_key` / `metadata.user_id` name sessions (off: headers alone; docs/capture.md).
    capture_body_keys: bool = False
    # A captured request asks vLLM for the sampled tokens' logprobs, taken back out of the client's answer
    # (docs/capture.md, Logprobs); needs capture.
    capture_logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _mode(self.mode, "mode"))
        if not isinstance(self.allow_mode_header, bool):
            raise ConfigError(f"allow_mode_header: expected True or False, got {self.allow_mode_header!r}")
        if not _positive_int(self.max_body_bytes):
            raise ConfigError(f"max_body_bytes: expected a positive integer, got {self.max_body_bytes!r}")
        if not isinstance(self.strip_kv_remote_address, bool):
            raise ConfigError(f"strip_kv_remote_address: expected True or False, got {self.strip_kv_remote_address!r}")
        if not isinstance(self.pure_python, bool):
            raise ConfigError(f"pure_python: expected True or False, got {self.pure_python!r}")
        object.__setattr__(self, "capture", capture_url(self.capture, "capture"))
        if not _positive_int(self.capture_max_bytes):
            raise ConfigError(f"capture_max_bytes: expected a positive integer, got {self.capture_max_bytes!r}")
        if not _positive_int(self.capture_retention_s):
            raise ConfigError(f"capture_retention_s: expected a positive integer, got {self.capture_retention_s!r}")
        if not _positive_int(self.capture_queue_bytes):
            raise ConfigError(f"capture_queue_bytes: expected a positive integer, got {self.capture_queue_bytes!r}")
        if not isinstance(self.continue_ids, bool):
            raise ConfigError(f"continue_ids: expected True or False, got {self.continue_ids!r}")
        object.__setattr__(self, "capture_api", _capture_api(self.capture_api, "capture_api"))
        if not isinstance(self.capture_body_keys, bool):
            raise ConfigError(f"capture_body_keys: expected True or False, got {self.capture_body_keys!r}")
        if not isinstance(self.capture_logprobs, bool):
            raise ConfigError(f"capture_logprobs: expected True or False, got {self.capture_logprobs!r}")
        if self.continue_ids and self.capture is None:
            raise ConfigError(
                f"continue_ids ({ENV_CONTINUE_IDS}=1) needs capture on ({ENV_CAPTURE}, or `capture=`): "
                "it continues the ids of the captured session's last turn (docs/capture.md)"
            )
        if self.capture_logprobs and self.capture is None:
            raise ConfigError(
                f"capture_logprobs ({ENV_CAPTURE_LOGPROBS}=1) needs capture on ({ENV_CAPTURE}, or `capture=`): "
                "it asks vLLM for the logprobs of captured requests (docs/capture.md)"
            )

    @classmethod
    def create(
        cls,
        *,
        mode: Mode | str | None = None,
        allow_mode_header: bool | None = None,
        max_body_bytes: int | None = None,
        strip_kv_remote_address: bool | None = None,
        pure_python: bool | None = None,
        capture: str | None = None,
        capture_max_bytes: int | None = None,
        capture_retention_s: int | None = None,
        continue_ids: bool | None = None,
        capture_api: CaptureApi | str | None = None,
        capture_body_keys: bool | None = None,
        capture_logprobs: bool | None = None,
        base: Settings | None = None,
    ) -> Settings:
        """Settings from keyword arguments; each one left at None comes from `base` (default: the environment)."""
        if base is None:
            # The environment's, less the settings that need capture: checked below with the capture these
            # arguments give.
            if continue_ids is None:
                continue_ids = _parse_bool(os.environ, ENV_CONTINUE_IDS, False)
            if capture_logprobs is None:
                capture_logprobs = _parse_bool(os.environ, ENV_CAPTURE_LOGPROBS, False)
            needs_capture = (ENV_CONTINUE_IDS, ENV_CAPTURE_LOGPROBS)
            base = cls.from_env({k: v for k, v in os.environ.items() if k not in needs_capture})
        return cls(
            mode=base.mode if mode is None else _mode(mode, "mode"),
            allow_mode_header=base.allow_mode_header if allow_mode_header is None else allow_mode_header,
            max_body_bytes=base.max_body_bytes if max_body_bytes is None else max_body_bytes,
            strip_kv_remote_address=(
                base.strip_kv_remote_address if strip_kv_remote_address is None else strip_kv_remote_address
            ),
            pure_python=base.pure_python if pure_python is None else pure_python,
            capture=base.capture if capture is None else capture,
            capture_max_bytes=base.capture_max_bytes if capture_max_bytes is None else capture_max_bytes,
            capture_retention_s=base.capture_retention_s if capture_retention_s is None else capture_retention_s,
            capture_queue_bytes=base.capture_queue_bytes,
            continue_ids=base.continue_ids if continue_ids is None else continue_ids,
            capture_api=base.capture_api if capture_api is None else _capture_api(capture_api, "capture_api"),
            capture_body_keys=base.capture_body_keys if capture_body_keys is None else capture_body_keys,
            capture_logprobs=base.capture_logprobs if capture_logprobs is None else capture_logprobs,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        mode = _mode(env.get(ENV_MODE, "auto") or "auto", ENV_MODE)
        allow = _parse_bool(env, ENV_ALLOW_MODE_HEADER, True)
        cap = _parse_positive(env, ENV_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES)
        strip = _parse_bool(env, ENV_STRIP_KV_REMOTE_ADDRESS, False)
        pure = _parse_bool(env, ENV_PURE_PYTHON, False)
        return cls(
            mode=mode,
            allow_mode_header=allow,
            max_body_bytes=cap,
            strip_kv_remote_address=strip,
            pure_python=pure,
            capture=capture_url(env.get(ENV_CAPTURE), ENV_CAPTURE),
            capture_max_bytes=_parse_positive(env, ENV_CAPTURE_MAX_BYTES, DEFAULT_CAPTURE_MAX_BYTES),
            capture_retention_s=_parse_positive(env, ENV_CAPTURE_RETENTION_S, DEFAULT_CAPTURE_RETENTION_S),
            capture_queue_bytes=_parse_positive(env, ENV_CAPTURE_QUEUE_BYTES, DEFAULT_CAPTURE_QUEUE_BYTES),
            continue_ids=_parse_bool(env, ENV_CONTINUE_IDS, False),
            capture_api=_capture_api(env.get(ENV_CAPTURE_API, "").strip() or CaptureApi.KEYED, ENV_CAPTURE_API),
            capture_body_keys=_parse_bool(env, ENV_CAPTURE_BODY_KEYS, False),
            capture_logprobs=_parse_bool(env, ENV_CAPTURE_LOGPROBS, False),
        )


def _mode(value: object, name: str) -> Mode:
    if isinstance(value, Mode):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected one of {'|'.join(m.value for m in Mode)}, got {value!r}")
    try:
        return Mode.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _capture_api(value: object, name: str) -> CaptureApi:
    if isinstance(value, CaptureApi):
        return value
    try:
        return CaptureApi(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise ConfigError(f"{name}: expected one of {'|'.join(a.value for a in CaptureApi)}, got {value!r}") from None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def capture_environ(settings: Settings) -> dict[str, str]:
    """The VLLM_NVEXT_CAPTURE* variables that give another process (vLLM's, a proxy worker) these capture settings."""
    if settings.capture is None:
        return {}
    return {
        ENV_CAPTURE: settings.capture,
        ENV_CAPTURE_MAX_BYTES: str(settings.capture_max_bytes),
        ENV_CAPTURE_RETENTION_S: str(settings.capture_retention_s),
        ENV_CAPTURE_QUEUE_BYTES: str(settings.capture_queue_bytes),
        ENV_CONTINUE_IDS: "1" if settings.continue_ids else "0",
        ENV_CAPTURE_API: settings.capture_api.value,
        ENV_CAPTURE_BODY_KEYS: "1" if settings.capture_body_keys else "0",
        ENV_CAPTURE_LOGPROBS: "1" if settings.capture_logprobs else "0",
    }


def capture_url(value: object, name: str) -> str | None:
    """The capture store's URL, or None when unset or empty (capture off); the store checks the rest."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a store URL (sqlite:////path or redis://host:port/db), got {value!r}")
    url = value.strip()
    if not url:
        return None
    if not url.lower().startswith(CAPTURE_SCHEMES):
        # Never echo the value: a Redis URL may carry a password.
        raise ConfigError(f"{name}: expected a store URL starting with {', '.join(CAPTURE_SCHEMES)}")
    return url


def capture_password(environ: Mapping[str, str] | None = None) -> str | None:
    """The Redis store's password when its URL carries none: VLLM_NVEXT_CAPTURE_PASSWORD, or the file that
    VLLM_NVEXT_CAPTURE_PASSWORD_FILE names (its first line), so it never sits in a command line (docs/capture.md)."""
    env = os.environ if environ is None else environ
    value, path = env.get(ENV_CAPTURE_PASSWORD) or None, env.get(ENV_CAPTURE_PASSWORD_FILE, "").strip()
    if value is not None and path:
        raise ConfigError(f"{ENV_CAPTURE_PASSWORD} and {ENV_CAPTURE_PASSWORD_FILE}: set one, not both")
    if not path:
        return value
    try:
        with open(path, encoding="utf-8") as file:
            first = file.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        raise ConfigError(f"{ENV_CAPTURE_PASSWORD_FILE}: the file cannot be read") from None  # never its path
    if not first:
        raise ConfigError(f"{ENV_CAPTURE_PASSWORD_FILE}: the file's first line is empty")
    return first


def _parse_positive(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {raw!r}")
    return value


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 0 or 1, got {raw!r}")


K = TypeVar("K")
V = TypeVar("V")


def keep(kept: dict[K, V], key: K, value: V, limit: int) -> V:
    """Keep `value` under `key` in `kept`, which then holds at most `limit` entries; returns `value`.

    What the middleware keeps per distinct input (readings, plans, header values) is bounded this way,
    so values clients make up cannot grow it. Each kept map is a plain dict read with `.get` (a dict
    subclass or wrapper makes every hit slower); only a miss goes through `keep`.

    The policy: clear when full. A hit costs nothing beyond the dict lookup (no recency to update,
    as least-recently-used eviction would on every hit), and a burst of made-up values only makes
    the next few requests re-make what they use (one miss each), whereas a map that stops adding
    when full would keep the burst for the process's life and never keep the real values again.
    """
    if len(kept) >= limit:
        kept.clear()
    kept[key] = value
    return value
