"""What the middleware keeps per distinct input (readings, plans, header values): bounded, so values
clients make up cannot grow it.

Each kept map is a plain dict read with `.get` (a dict subclass or wrapper makes every hit slower);
only a miss goes through `keep`.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def keep(kept: dict[K, V], key: K, value: V, limit: int) -> V:
    """Keep `value` under `key` in `kept`, which then holds at most `limit` entries; returns `value`.

    The policy: clear when full. A hit costs nothing beyond the dict lookup (no recency to update,
    as least-recently-used eviction would on every hit), and a burst of made-up values only makes
    the next few requests re-make what they use (one miss each), whereas a map that stops adding
    when full would keep the burst for the process's life and never keep the real values again.
    """
    if len(kept) >= limit:
        kept.clear()
    kept[key] = value
    return value
