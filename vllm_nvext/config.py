"""Compatibility modes and server settings, read from the environment and validated once."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_MODE = "VLLM_NVEXT_MODE"
ENV_ALLOW_MODE_HEADER = "VLLM_NVEXT_ALLOW_MODE_HEADER"
ENV_MAX_BODY_BYTES = "VLLM_NVEXT_MAX_BODY_BYTES"
ENV_STRIP_KV_REMOTE_ADDRESS = "VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS"
ENV_PURE_PYTHON = "VLLM_NVEXT_PURE_PYTHON"
MODE_HEADER = "x-nvext-mode"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

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

    @classmethod
    def create(
        cls,
        *,
        mode: Mode | str | None = None,
        allow_mode_header: bool | None = None,
        max_body_bytes: int | None = None,
        strip_kv_remote_address: bool | None = None,
        pure_python: bool | None = None,
        base: Settings | None = None,
    ) -> Settings:
        """Settings from keyword arguments; each one left at None comes from `base` (default: the environment)."""
        if base is None:
            base = cls.from_env()
        return cls(
            mode=base.mode if mode is None else _mode(mode, "mode"),
            allow_mode_header=base.allow_mode_header if allow_mode_header is None else allow_mode_header,
            max_body_bytes=base.max_body_bytes if max_body_bytes is None else max_body_bytes,
            strip_kv_remote_address=(
                base.strip_kv_remote_address if strip_kv_remote_address is None else strip_kv_remote_address
            ),
            pure_python=base.pure_python if pure_python is None else pure_python,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        mode = _mode(env.get(ENV_MODE, "auto") or "auto", ENV_MODE)
        allow = _parse_bool(env, ENV_ALLOW_MODE_HEADER, True)
        raw_cap = env.get(ENV_MAX_BODY_BYTES, "").strip()
        if raw_cap:
            try:
                cap = int(raw_cap)
            except ValueError:
                cap = 0
            if cap <= 0:
                raise ConfigError(f"{ENV_MAX_BODY_BYTES}: expected a positive integer, got {raw_cap!r}")
        else:
            cap = DEFAULT_MAX_BODY_BYTES
        strip = _parse_bool(env, ENV_STRIP_KV_REMOTE_ADDRESS, False)
        pure = _parse_bool(env, ENV_PURE_PYTHON, False)
        return cls(
            mode=mode, allow_mode_header=allow, max_body_bytes=cap, strip_kv_remote_address=strip, pure_python=pure
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


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 0 or 1, got {raw!r}")
