"""Settings come from the environment, validated once: a bad value stops the server."""

from __future__ import annotations

import pytest

from vllm_nvext import ConfigError, Mode, NvextMiddleware, Settings
from vllm_nvext.config import DEFAULT_MAX_BODY_BYTES, capture_environ


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


# --- capture (docs/capture.md) ----------------------------------------------------------------


def test_capture_is_off_unless_a_store_url_is_set():
    assert Settings.from_env({}).capture is None
    assert Settings.from_env({"VLLM_NVEXT_CAPTURE": "  "}).capture is None
    env = {
        "VLLM_NVEXT_CAPTURE": "sqlite:////var/lib/nvext/capture.sqlite3",
        "VLLM_NVEXT_CAPTURE_MAX_BYTES": "4096",
        "VLLM_NVEXT_CAPTURE_RETENTION_S": "60",
    }
    settings = Settings.from_env(env)
    assert (settings.capture, settings.capture_max_bytes, settings.capture_retention_s) == (
        "sqlite:////var/lib/nvext/capture.sqlite3",
        4096,
        60,
    )
    # A keyword's empty URL turns capture off where the environment had it on.
    assert Settings.create(capture="", base=settings).capture is None
    # The queue's byte bound from the environment reaches the keywords' settings and the processes started with them.
    queued = Settings.from_env({**env, "VLLM_NVEXT_CAPTURE_QUEUE_BYTES": "1048576"})
    assert Settings.create(capture_max_bytes=8192, base=queued).capture_queue_bytes == 1048576
    assert capture_environ(queued)["VLLM_NVEXT_CAPTURE_QUEUE_BYTES"] == "1048576"


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"VLLM_NVEXT_CAPTURE": "postgres://db/capture"}, "VLLM_NVEXT_CAPTURE"),
        ({"VLLM_NVEXT_CAPTURE_MAX_BYTES": "0"}, "VLLM_NVEXT_CAPTURE_MAX_BYTES"),
        ({"VLLM_NVEXT_CAPTURE_RETENTION_S": "a week"}, "VLLM_NVEXT_CAPTURE_RETENTION_S"),
        ({"VLLM_NVEXT_CAPTURE_QUEUE_BYTES": "lots"}, "VLLM_NVEXT_CAPTURE_QUEUE_BYTES"),
    ],
)
def test_invalid_capture_settings_are_refused_naming_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        Settings.from_env(env)


def test_a_refused_capture_url_is_not_echoed():
    """A Redis URL may carry a password: the error names the variable, never the value."""
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"VLLM_NVEXT_CAPTURE": "mysql://root:hunter2@db/x"})
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"capture": 3}, "capture"),
        ({"capture_max_bytes": -1}, "capture_max_bytes"),
        ({"capture_retention_s": 1.5}, "capture_retention_s"),
    ],
)
def test_invalid_capture_keywords_are_refused_naming_the_keyword(kwargs, name):
    with pytest.raises(ConfigError, match=f"^{name}: "):
        Settings.create(base=Settings(), **kwargs)
