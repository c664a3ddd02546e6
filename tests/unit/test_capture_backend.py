"""The store's interface (`capture/base.py`), the same tests over both backends: a real SQLite file and a real
redis-server (`store_url`, tests/unit/conftest.py). What one backend promises the other keeps: the turns read
back in order, each placed against the one before, paged by size; a delete, the sessions listed since a time,
retention, the size cap."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.support.capture import make_turn
from vllm_nvext.capture.base import Backend, StoreFull
from vllm_nvext.capture.store import open_backend


@pytest.fixture
def backend(store_url: str) -> Iterator[Backend]:
    opened = open_backend(store_url, retention_s=100)
    yield opened
    opened.close()


def _turns(backend: Backend, session_id: str) -> list[dict[str, object]] | None:
    page = backend.read(session_id, 0, 1 << 30)
    return None if page is None else [json.loads(t) for t in page.turns]


def test_turns_read_back_in_order_each_placed_against_the_one_before(backend: Backend) -> None:
    now = time.time()
    backend.write([make_turn("agent", [1, 2], [3]), make_turn("other", [9])], now)
    backend.write([make_turn("agent", [1, 2, 3, 4], [5]), make_turn("agent", [7], [8])], now)
    turns = _turns(backend, "agent")
    assert turns is not None
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert [t["extends_previous"] for t in turns] == [None, True, False]
    assert [t["prompt_token_ids"] for t in turns] == [[1, 2], [1, 2, 3, 4], [7]]
    assert [t["prompt_token_ids"] for t in _turns(backend, "other") or []] == [[9]]
    assert backend.read("never-seen", 0, 1 << 30) is None


def test_a_page_holds_at_least_one_turn_and_says_where_the_next_starts(backend: Backend) -> None:
    backend.write([make_turn("big", list(range(500 * (i + 1)))) for i in range(4)], time.time())
    first = backend.read("big", 0, 1)
    assert first is not None and len(first.turns) == 1 and first.next_index == 1
    seen: list[str] = []
    start: int | None = 0
    while start is not None:
        page = backend.read("big", start, 6_000)
        assert page is not None and page.turns
        seen += page.turns
        start = page.next_index
    assert [json.loads(t)["index"] for t in seen] == [0, 1, 2, 3]
    last = backend.read("big", 3, 1 << 30)
    assert last is not None and len(last.turns) == 1 and last.next_index is None


def test_a_delete_removes_one_session_and_says_whether_there_was_one(backend: Backend) -> None:
    backend.write([make_turn("a", [1]), make_turn("b", [2])], time.time())
    assert backend.delete("a") is True
    assert backend.delete("a") is False
    assert backend.read("a", 0, 1 << 30) is None
    assert list(backend.sessions(None)) == ["b"]
    backend.write([make_turn("a", [3])], time.time())
    assert [t["index"] for t in _turns(backend, "a") or []] == [0]  # a session written anew starts again


def test_sessions_are_listed_oldest_first_from_a_time(backend: Backend) -> None:
    now = time.time()
    backend.write([make_turn("early", [1])], now - 30)
    backend.write([make_turn("late", [2])], now)
    backend.write([make_turn("middle", [3])], now - 10)
    assert list(backend.sessions(None)) == ["early", "middle", "late"]
    assert list(backend.sessions(now - 20)) == ["middle", "late"]
    assert list(backend.sessions(now + 1)) == []


def test_retention_removes_the_sessions_whose_last_turn_is_older(backend: Backend) -> None:
    now = time.time()
    backend.write([make_turn("old", [1])], now - 150)
    backend.write([make_turn("kept", [2])], now - 150)
    backend.write([make_turn("kept", [2, 3])], now)
    assert backend.prune(now) == 1
    assert list(backend.sessions(None)) == ["kept"]
    assert backend.prune(now) == 0


def test_a_store_at_its_cap_refuses_the_batch_and_holds_none_of_it(store_url: str) -> None:
    full = open_backend(store_url, max_bytes=1)
    try:
        assert full.used_bytes() >= 1
        with pytest.raises(StoreFull):
            full.write([make_turn("s", [1]), make_turn("s", [2])], time.time())
        assert full.read("s", 0, 1 << 30) is None
    finally:
        full.close()
