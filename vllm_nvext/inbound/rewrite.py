"""The rewrite of a request body's root members: what vLLM gets instead of the client's bytes.

Every member the rewrite does not name reaches vLLM as the client wrote it (docs/protocol.md §3).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import _json
from ..config import keep
from ..protocol import PROMPT_TOKEN_IDS

__all__ = ["BodyRewrite", "SpliceRoot"]


# The compiled root splice (`_speedups.splice_root`, handed in by the ASGI layer): the body with the
# root members named (UTF-8 bytes) left out and the added ones (encoded, joined by commas) appended;
# None leaves the body to the Python path.
SpliceRoot = Callable[[bytes, tuple[bytes, ...], bytes], "bytes | None"]


class BodyRewrite:
    """Root members to drop or set; everything else reaches vLLM as the client wrote it."""

    __slots__ = ("dropped", "added", "kv_prompt_ids", "sources", "_args")

    def __init__(self) -> None:
        self.dropped: set[str] = set()
        self.added: dict[str, str] = {}
        self.kv_prompt_ids: list[int] | None = None
        self.sources: dict[str, str] = {}  # vLLM's field -> the nvext field it was set from
        self._args: tuple[tuple[bytes, ...], bytes] | None = None  # `splice_args`, once asked

    def drop(self, key: str) -> None:
        self._args = None
        self.dropped.add(key)

    def set(self, key: str, encoded: str, source: str | None = None) -> None:
        self._args = None
        self.dropped.add(key)
        self.added[key] = encoded
        if source is not None:
            self.sources[key] = source

    def apply(self, body: bytes, splice_root: SpliceRoot | None = None) -> bytes | None:
        """The body vLLM gets, None: the client's bytes. `splice_root` (compiled) splices it when it
        can, with the Python path's bytes (tests/unit/test_request_splice.py)."""
        if not self.dropped and self.kv_prompt_ids is None:
            return None
        if splice_root is not None and self.kv_prompt_ids is None:
            spliced = splice_root(body, *self.splice_args())
            if spliced is not None:
                return spliced
        text = _json.text_of(body)
        start = len(text) - len(text.lstrip(" \t\n\r"))
        if self.kv_prompt_ids is not None:
            members, _ = _json.object_members(text, start)
            kv = [m for m in members if m.key == "kv_transfer_params"]
            ids = _json.dumps_text(self.kv_prompt_ids)
            if kv and text[kv[-1].value_start] == "{":  # the last duplicate is the one vLLM reads
                value = text[kv[-1].value_start : kv[-1].end]
                self.set(
                    "kv_transfer_params",
                    _json.splice_object(value, 0, frozenset({PROMPT_TOKEN_IDS}), [(PROMPT_TOKEN_IDS, ids)]),
                )
            else:
                self.set("kv_transfer_params", f'{{"{PROMPT_TOKEN_IDS}":{ids}}}')
        text = _json.splice_object(text, start, frozenset(self.dropped), list(self.added.items()))
        return _json.encode_text(text)

    def splice_args(self) -> tuple[tuple[bytes, ...], bytes]:
        """`splice_root`'s names to drop and members to append, kept per rewrite (a few kinds) and
        on the rewrite itself (a kept plan's rewrite splices every body of its kind)."""
        if self._args is not None:
            return self._args
        key = (frozenset(self.dropped), tuple(self.added.items()))
        known = _SPLICE_ARGS.get(key)
        if known is None:
            extra = ",".join(f"{_json.dumps_text(key)}:{value}" for key, value in self.added.items())
            known = (tuple(_json.encode_text(key) for key in self.dropped), _json.encode_text(extra))
            keep(_SPLICE_ARGS, key, known, _SPLICE_ARGS_MAX)  # values the client set (a cache_salt) cannot grow it
        self._args = known
        return known


_SPLICE_ARGS: dict[tuple[frozenset[str], tuple[tuple[str, str], ...]], tuple[tuple[bytes, ...], bytes]] = {}
_SPLICE_ARGS_MAX = 256
