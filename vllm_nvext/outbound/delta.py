"""The byte-level mid-stream delta of a single-choice stream: the general path's bytes without decoding it.

`stream.StreamReshaper` learns a stream's root from a decoded chunk (`chunk_root`: the bytes up to
`"choices":[`, which vLLM writes the same on every chunk of a stream), then reads here each delta of that
root the splice does not serve (`splice.Splice`): one whose bytes around the ids are the last matched
delta's (`ids_between`: vLLM writes the same bytes around every delta of a stream), else one whose only
choice ends as `_DELTA_TAIL` matches (`tail_match`: any layout that only adds null-valued keys after the
ids or at the root). Inside a JSON string every quote is escaped, so the key tokens matched here cannot
come from text. `delta_bytes` gives such a delta the general path's bytes: vLLM's copy of the ids back to
null (strip), the ids into the chunk's nvext (trio), every other byte as vLLM wrote it. Same bytes as
decoding (for the valid JSON vLLM writes):
tests/unit/test_stream_layouts.py::test_byte_level_path_gives_the_general_paths_bytes. Nothing here
knows ASGI or holds a stream's state.
"""

from __future__ import annotations

import re

from .chunks import ChunkReshaper
from .finish import Scanner
from .splice import kept_json

_FINISH_KEY = b'"finish_reason":'
# A null-valued key other than those the general path reads or writes (no duplicate can hide).
_NULL_KEY = rb',"(?!(?:token_ids|finish_reason|choices|nvext)")[a-z_]+":null'
# The tail vLLM writes for a mid-stream delta of its only choice: an unfinished finish_reason,
# then only null-valued keys (stop_reason, prompt_token_ids, ...), then the delta's ids, then
# only null-valued keys (0.33: weight_versions), the end of the choice and of `choices`, only
# null-valued root keys (0.33: kv_transfer_params) and the end of the chunk. Group 1: the ids;
# group 2: everything after them. Anything else is decoded.
_DELTA_TAIL = re.compile(
    rb'"finish_reason":null(?:' + _NULL_KEY + rb')*,"token_ids":(null|\[[0-9,]*\])'
    rb"((?:" + _NULL_KEY + rb")*\}\](?:" + _NULL_KEY + rb")*\}\n\n)\Z"
)
_ID_BYTES = b"0123456789,"
_CHOICES = b'"choices":['
# Root keys the general path rewrites on a mid-stream delta (docs/protocol.md §3.4): a chunk with
# one of them before `choices` is never served by the byte-level path.
_ROOT_REWRITTEN = (b'"prompt_token_ids":', b'"nvext":')
_JSON_AT = len(b"data: ")  # where the chunk's JSON object starts
_EVENT_END = b"\n\n"
_CHUNK_END = len(b"}" + _EVENT_END)  # the chunk object's closing brace and the event's end
_LIST = ord("[")


def chunk_root(event: bytes) -> bytes | None:
    """The root bytes before `choices` of a decoded chunk; None if deltas must stay decoded.

    Inside a JSON string every quote is escaped, so the key tokens found here are keys; the
    root ends at the last `"choices":[` before the first choice's `finish_reason`, so a root
    value holding a `choices` list of its own cannot end it early.
    """
    end = event.rfind(_CHOICES, 0, max(event.find(_FINISH_KEY), 0))
    if end < 0 or event[_JSON_AT : _JSON_AT + 1] != b"{":
        return None
    root = event[: end + len(_CHOICES)]
    if _ROOT_REWRITTEN[0] in root or _ROOT_REWRITTEN[1] in root:
        return None
    return root


_CHOICE_0 = b'"choices":[{"index":'


def scanned_root(event: bytes, scan: Scanner) -> bytes | None:
    """`chunk_root` for a chunk without a finish reason (vllm-rs writes none on a delta), read by the plain-chunk
    scanner (`plain.plain_chunk` or its compiled twin): the bytes up to the root's `"choices":[`, found where
    choice 0's `index` is its first key; None if the chunk is not plain or its choice 0 starts otherwise."""
    spans = scan(event)
    if spans is None or spans[0] < 1:
        return None
    at = spans[5] - len(_CHOICE_0)  # choice 0's index value, which the root's `"choices":[{"index":` precedes
    if at <= _JSON_AT or not event.startswith(_CHOICE_0, at):
        return None
    root = event[: at + len(_CHOICES)]
    if _ROOT_REWRITTEN[0] in root or _ROOT_REWRITTEN[1] in root:
        return None
    return root


def _only_choice(event: bytes, root: bytes, pos: int) -> bool:
    """The finish key at `pos` is the only one after the `root` (one choice), and the chunk's strings
    before it are ones a decode writes back as they are (`splice.kept_json`)."""
    end = len(root)
    return event.startswith(root) and event.find(_FINISH_KEY, end) == pos and kept_json(event, end, pos)


def tail_match(event: bytes, root: bytes) -> re.Match[bytes] | None:
    """`_DELTA_TAIL` matched from the finish key of a delta's only choice, after the stream's `root` (group 1: its ids,
    group 2: everything after them); None: not such a delta, decode it."""
    pos = event.rfind(_FINISH_KEY)
    # first == last occurrence: exactly one choice in this chunk
    return _DELTA_TAIL.match(event, pos) if pos > 0 and _only_choice(event, root, pos) else None


def ids_between(event: bytes, root: bytes, head: bytes, tail: bytes) -> int:
    """Where the ids of a delta (one choice, after the stream's `root`) start when the bytes around them are the last
    matched delta's: `head` from its finish key to the ids, `tail` after them (`event` ends with it); -1: not so."""
    end = len(event) - len(tail)
    start = event.rfind(b"[", 0, end)
    pos = start - len(head)
    if (
        pos > _JSON_AT
        and event.startswith(head, pos)
        and not event[start + 1 : end - 1].translate(None, _ID_BYTES)
        and event[end - 1 : end] == b"]"
        and _only_choice(event, root, pos)
    ):
        return start
    return -1


def delta_bytes(event: bytes, start: int, end: int, chunks: ChunkReshaper, strip: bool, trio: bool) -> bytes | None:
    """The client's bytes for a mid-stream delta whose ids (a list, or null) sit at event[start:end], what `chunks`
    records of it recorded; None: it goes out as it came."""
    ids = event[start:end]
    listed = ids[0] == _LIST  # else null: vLLM withheld the ids, which stay unreported
    if not listed or chunks.engine or chunks.timed:  # else nothing reads a listed delta's ids
        chunks.first_choice(event, start, end)
    strip = strip and listed  # vLLM's copy goes back to null, an empty one too
    if trio:
        return b"".join(
            (
                event[:start] + b"null" if strip else event[:end],
                event[end:-_CHUNK_END],  # up to the chunk's closing brace, where nvext goes
                b',"nvext":{"completion_token_ids":',
                ids,
                b"}}" + _EVENT_END,
            )
        )
    return event[:start] + b"null" + event[end:] if strip else None
