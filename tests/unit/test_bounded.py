"""What the middleware keeps per distinct input stays bounded, and a kept answer is the answer."""

from __future__ import annotations

from vllm_nvext import asgi, config


def test_a_kept_map_never_holds_more_than_its_limit_and_keeps_the_newest():
    kept: dict[str, int] = {}
    for i in range(10):
        assert config.keep(kept, f"made-up-{i}", i, 4) == i
        assert len(kept) <= 4, "made-up values cannot grow it past its limit"
        assert kept[f"made-up-{i}"] == i, "what was just kept is there for the next request"
    assert config.keep(kept, "made-up-9", 9, 4) == 9 and kept["made-up-9"] == 9


def test_after_a_burst_of_made_up_values_the_real_ones_are_kept_again(monkeypatch):
    """Content types: a burst of made-up values fills the map, the next real one is kept again."""
    monkeypatch.setattr(asgi, "_MEDIA_TYPES", {})
    monkeypatch.setattr(asgi, "_JSON_TYPES", {})
    for i in range(asgi._MEDIA_TYPES_MAX * 2):
        assert asgi.read_as_json(f"application/x{i}+json; q={i}".encode())
        assert not asgi.read_as_json(f"text/x{i}".encode())
        assert len(asgi._MEDIA_TYPES) <= asgi._MEDIA_TYPES_MAX and len(asgi._JSON_TYPES) <= asgi._MEDIA_TYPES_MAX
    assert asgi.read_as_json(b"Application/JSON; charset=utf-8")
    assert asgi._JSON_TYPES[b"Application/JSON; charset=utf-8"] is True, "kept after the burst"
    assert asgi.media_type(b"text/event-stream; charset=utf-8") == "text/event-stream"
    assert b"text/event-stream; charset=utf-8" in asgi._MEDIA_TYPES
