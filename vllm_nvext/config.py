"""Compatibility modes and server settings, read from the environment and validated once."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_MODE = "VLLM_NVEXT_MODE"
ENV_ALLOW_MODE_HEADER = "VLLM_NVEXT_ALLOW_MODE_HEADER"
ENV_MAX_BODY_BYTES = "VLLM_NVEXT_MAX_BODY_BYTES"
MODE_HEADER = "x-nvext-mode"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """An invalid setting; the server refuses to start with it."""


class Mode(str, enum.Enum):
    """Where the token-id trio (completion ids, prompt ids, kv_transfer_params) goes."""

    AUTO = "auto"  # follow the request's dialect
    VLLM = "vllm"  # vLLM placement (PROTOCOL §1)
    NVEXT = "nvext"  # Dynamo placement, PR #13588 semantics (PROTOCOL §3)
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
    mode: Mode = Mode.AUTO
    allow_mode_header: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        try:
            mode = Mode.parse(env.get(ENV_MODE, "auto") or "auto")
        except ValueError as exc:
            raise ConfigError(f"{ENV_MODE}: {exc}") from None
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
        return cls(mode=mode, allow_mode_header=allow, max_body_bytes=cap)


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 0 or 1, got {raw!r}")
