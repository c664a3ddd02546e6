"""Settings come from the environment, validated once: a bad value stops the server."""

from __future__ import annotations

import pytest

from vllm_nvext import ConfigError, Mode, NvextMiddleware, Settings
from vllm_nvext.config import DEFAULT_MAX_BODY_BYTES


def test_defaults():
    assert Settings.from_env({}) == Settings(Mode.AUTO, True, DEFAULT_MAX_BODY_BYTES)


def test_values_are_read():
    env = {"VLLM_NVEXT_MODE": " NVEXT ", "VLLM_NVEXT_ALLOW_MODE_HEADER": "0", "VLLM_NVEXT_MAX_BODY_BYTES": "1024"}
    assert Settings.from_env(env) == Settings(Mode.NVEXT, False, 1024)


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"VLLM_NVEXT_MODE": "dynamo"}, "VLLM_NVEXT_MODE"),
        ({"VLLM_NVEXT_ALLOW_MODE_HEADER": "maybe"}, "VLLM_NVEXT_ALLOW_MODE_HEADER"),
        ({"VLLM_NVEXT_MAX_BODY_BYTES": "-5"}, "VLLM_NVEXT_MAX_BODY_BYTES"),
        ({"VLLM_NVEXT_MAX_BODY_BYTES": "lots"}, "VLLM_NVEXT_MAX_BODY_BYTES"),
    ],
)
def test_invalid_values_are_refused_naming_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        Settings.from_env(env)


def test_middleware_built_by_vllm_reads_and_validates_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_NVEXT_MODE", "both")
    assert NvextMiddleware(lambda *a: None).settings.mode is Mode.BOTH
    monkeypatch.setenv("VLLM_NVEXT_MODE", "sideways")
    with pytest.raises(ConfigError, match="VLLM_NVEXT_MODE"):
        NvextMiddleware(lambda *a: None)


def test_invalid_environment_fails_the_app_start_up_for_both_mounts(monkeypatch):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from vllm_nvext.plugin import NvextPlugin

    monkeypatch.setenv("VLLM_NVEXT_MODE", "sideways")
    app = Starlette()
    app.add_middleware(NvextMiddleware)  # what `--middleware vllm_nvext.NvextMiddleware` does
    with pytest.raises(ConfigError, match="VLLM_NVEXT_MODE"), TestClient(app):
        pass
    with pytest.raises(ConfigError, match="VLLM_NVEXT_MODE"):
        NvextPlugin().attach_router(Starlette())  # vLLM calls this while building its app


# --- keyword arguments: the same rules as the environment ------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_body_bytes": -5}, "max_body_bytes"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": True}, "max_body_bytes"),
        ({"max_body_bytes": "1024"}, "max_body_bytes"),
        ({"mode": "dynamo"}, "mode"),
        ({"mode": 3}, "mode"),
        ({"allow_mode_header": "0"}, "allow_mode_header"),
        ({"allow_mode_header": 1}, "allow_mode_header"),
    ],
)
def test_invalid_keyword_arguments_are_refused_naming_the_keyword(monkeypatch, kwargs, name):
    monkeypatch.delenv("VLLM_NVEXT_MAX_BODY_BYTES", raising=False)
    with pytest.raises(ConfigError, match=f"^{name}: "):
        NvextMiddleware(lambda *a: None, **kwargs)
    with pytest.raises(ConfigError, match=f"^{name}: "):
        Settings.create(base=Settings(), **kwargs)
    with pytest.raises(ConfigError, match=f"^{name}: "):
        Settings(**kwargs)


def test_keyword_arguments_override_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_NVEXT_MODE", "both")
    monkeypatch.setenv("VLLM_NVEXT_MAX_BODY_BYTES", "2048")
    app = NvextMiddleware(lambda *a: None, mode=" NVEXT ", allow_mode_header=False)
    assert app.settings == Settings(Mode.NVEXT, False, 2048)
    assert NvextMiddleware(lambda *a: None, max_body_bytes=1).settings == Settings(Mode.BOTH, True, 1)


def test_keyword_arguments_override_given_settings_and_skip_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_NVEXT_MODE", "sideways")  # not read: settings are given
    base = Settings(Mode.VLLM, False, 10)
    assert NvextMiddleware(lambda *a: None, settings=base).settings == base
    assert NvextMiddleware(lambda *a: None, settings=base, mode=Mode.BOTH).settings == Settings(Mode.BOTH, False, 10)


def test_a_mode_given_as_text_is_parsed():
    assert Settings(mode="Both").mode is Mode.BOTH  # type: ignore[arg-type]
