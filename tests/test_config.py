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
