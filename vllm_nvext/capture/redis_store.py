"""The fleet's capture store: Redis, shared by replicas behind a router and by proxy workers.

A session is a list of its turns' JSON (`nvext:capture:turns:<session id>`), its index the list's
position; a sorted set (`nvext:capture:sessions`, scored by the last turn's time) lists the
sessions for export and retention. A turn is appended in a WATCH/MULTI transaction, so two
replicas writing one session never give two turns one index. Retention is the list's TTL, renewed
by each turn; the size cap is checked against the server's `used_memory`. docs/capture.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..config import ConfigError
from .base import Page, PartlyWritten, StoreFull, readable
from .record import Turn

PREFIX = "nvext:capture:"
SESSIONS = PREFIX + "sessions"
READ_CHUNK = 16  # turns fetched per round trip by a read
_RETRIES = 64  # WATCH conflicts tolerated for one turn before it is given up (and counted dropped)
_BACKOFF_S = 0.05  # the longest wait between two tries (the writer's thread waits, never the event loop)


def _key(session_id: str) -> str:
    return PREFIX + "turns:" + session_id


class RedisBackend:
    def __init__(self, url: str, *, max_bytes: int, retention_s: int, password: str | None = None) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError(
                "capture: a redis:// store needs the Redis client: pip install 'vllm-nvext[capture-redis]'"
            ) from None
        try:
            # `password`: used where the URL carries none (a password in the URL wins, as redis-py reads it).
            self.client: Any = redis.Redis.from_url(
                url, password=password, socket_timeout=5.0, socket_connect_timeout=2.0
            )
        except ValueError:
            raise ConfigError("capture: the Redis store URL is not valid (redis://[:password@]host:port/db)") from None
        self._watch_error: type[Exception] = redis.WatchError
        self.max_bytes = max_bytes
        self.retention_s = retention_s

    def write(self, turns: Sequence[Turn], now: float) -> None:
        if self.used_bytes() >= self.max_bytes:
            raise StoreFull
        written, failure = 0, None
        for turn in turns:  # each turn its own transaction: one that fails does not take the others with it
            try:
                self._append(turn, now)
                written += 1
            except Exception as exc:
                failure = exc
        if failure is not None:
            raise PartlyWritten(written) from failure  # those written are recorded, the others dropped

    def _append(self, turn: Turn, now: float) -> None:
        key = _key(turn.session_id)
        with self.client.pipeline() as pipe:
            for attempt in range(_RETRIES):
                try:
                    pipe.watch(key)
                    index = int(pipe.llen(key))
                    last = pipe.lindex(key, -1) if index else None
                    previous = None if last is None else readable(last)
                    placed = turn.placed(index, previous)
                    pipe.multi()
                    pipe.rpush(key, json.dumps(placed.to_json(), separators=(",", ":"), allow_nan=False))
                    pipe.expire(key, self.retention_s)
                    pipe.zadd(SESSIONS, {turn.session_id: now})
                    pipe.execute()
                    return
                except self._watch_error:
                    # Another writer appended first: wait a random while, growing, so two writers that
                    # collided once do not collide again in lock-step.
                    time.sleep(random.uniform(0, min(_BACKOFF_S, 0.001 * 2**attempt)))
        raise RuntimeError("the session's list kept changing under the writer")

    def read(self, session_id: str, start: int, max_bytes: int) -> Page | None:
        key = _key(session_id)
        length = int(self.client.llen(key))
        if length == 0:
            return None
        turns: list[str] = []
        size = 0
        index = start
        while index < length:
            chunk = self.client.lrange(key, index, index + READ_CHUNK - 1)
            if not chunk:
                break  # the list was cut under the read (a delete): the end
            for raw in chunk:
                body = raw.decode("utf-8")
                if turns and size + len(body) > max_bytes:
                    return Page(turns, index)
                turns.append(body)
                size += len(body)
                index += 1
        return Page(turns, None)

    def delete(self, session_id: str) -> bool:
        with self.client.pipeline() as pipe:
            pipe.delete(_key(session_id))
            pipe.zrem(SESSIONS, session_id)
            removed, _ = pipe.execute()
        return bool(removed)

    def sessions(self, since: float | None) -> Iterator[str]:
        low: float | str = "-inf" if since is None else since
        for raw in self.client.zrangebyscore(SESSIONS, low, "+inf"):
            yield raw.decode("utf-8")

    def prune(self, now: float) -> int:
        """Sessions past the retention leave the sessions set (their lists expire by their TTL)."""
        return int(self.client.zremrangebyscore(SESSIONS, "-inf", now - self.retention_s))

    def used_bytes(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def close(self) -> None:
        self.client.close()
