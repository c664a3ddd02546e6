"""The session a captured request belongs to, from its headers and body (docs/capture.md, Session keys).

Pure. Header values and body values are client input: one that is not a valid session id
(`record.valid_session_id`: 1 to 256 of letters, digits and `._:~-`, not dots alone) is not a key (the next one in the
order is tried). Capture never
changes the client's answer, so an unusable key is skipped, never refused.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from .record import SIDE_KINDS, valid_session_id

# In order: the first that carries a usable value names the session, one trajectory per agent thread
# (docs/capture.md, Session keys). The URL's `/nvext/sessions/{id}` prefix comes before all of them (`URL_PREFIX`).
CLAUDE_CODE_SESSION = b"x-claude-code-session-id"
CLAUDE_CODE_AGENT = b"x-claude-code-agent-id"
THREAD_ID = b"thread-id"
SESSION_HEADERS: tuple[bytes, ...] = (
    b"x-nvext-session-id",  # ours
    b"x-dynamo-session-id",  # the session headers a Dynamo 1.6.1 frontend reads
    b"x-session-id",
    CLAUDE_CODE_SESSION,  # Claude Code, on every request; a subagent's thread is `{session}:{agent id}`
    THREAD_ID,  # Codex's thread: a subagent has its own (Dynamo 1.5+ keys Codex by it)
    b"session_id",  # Codex's conversation id, without thread-id (codex-api's build_conversation_headers)
    b"session-id",  # later Codex releases: the group of threads (the root and every subagent it spawns)
)
# The group a thread belongs to: Codex's session (shared by the root thread and its subagents), Claude Code's session.
GROUP_HEADERS: tuple[bytes, ...] = (b"session-id", b"session_id", CLAUDE_CODE_SESSION)
# Codex labels each request's kind here (JSON, `request_kind`: turn, prewarm, compaction, memory).
TURN_METADATA = b"x-codex-turn-metadata"
URL_PREFIX = "/nvext/sessions/"  # `/nvext/sessions/{id}/v1/...`: the session named by the URL (middleware/url.py)
URL_SOURCE = "url"
URL_SESSION = "vllm_nvext.url_session"  # the scope's key: the id the URL named (None: an invalid one, refused)
# Beside them: the parent session (or thread) and the subagent a request names, in order.
PARENT_HEADERS: tuple[bytes, ...] = (
    b"x-dynamo-parent-session-id",
    b"x-parent-session-id",
    b"x-claude-code-parent-agent-id",
    b"x-codex-parent-thread-id",
)
AGENT_HEADERS: tuple[bytes, ...] = (b"x-claude-code-agent-id", b"x-openai-subagent")
# Body keys, by route: Responses' `prompt_cache_key` (Codex sets it to its conversation id),
# Messages' `metadata.user_id` (Claude Code's carries its session).
PROMPT_CACHE_KEY = "prompt_cache_key"
METADATA_USER_ID = "metadata.user_id"
REQUEST_ID = "request_id"


class SessionKey(NamedTuple):
    """Where a request's session comes from; `session_id` None: its own one-turn session, named by
    the id vLLM gives the response (`source` is then "request_id")."""

    session_id: str | None
    source: str
    parent_id: str | None
    agent_id: str | None
    group_id: str | None = None
    request_kind: str | None = None


def usable(value: Any) -> str | None:
    """`value` as a key, or None when it is not one (not a string, empty, too long, odd characters)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str):
        return None
    text: str = value.strip()
    return text if valid_session_id(text) else None


def _first(headers: dict[bytes, bytes], names: tuple[bytes, ...]) -> tuple[str, str] | None:
    for name in names:
        value = usable(headers.get(name))
        if value is not None:
            return value, name.decode()
    return None


def request_kind(value: bytes | None) -> str | None:
    """Codex's `request_kind` from its `x-codex-turn-metadata` header (a JSON object); None where it sends none, or
    no usable one (a short name: letters, digits and `._:~-`)."""
    if value is None:
        return None
    try:
        metadata = json.loads(value)
    except (ValueError, RecursionError):
        return None
    kind = metadata.get("request_kind") if isinstance(metadata, dict) else None
    return kind if isinstance(kind, str) and len(kind) <= 64 and valid_session_id(kind) else None


def header_key(raw: Any, url_session: str | None = None) -> SessionKey:
    """The key the request's headers give (ASGI `(name, value)` pairs, names lower-case; the first of a
    repeated header counts, as starlette reads it); `session_id` None when none does. `url_session`: the id the
    URL's `/nvext/sessions/{id}` prefix named (already checked), before any header."""
    headers: dict[bytes, bytes] = {}
    for name, value in raw:
        headers.setdefault(bytes(name), bytes(value))
    session = (url_session, URL_SOURCE) if url_session is not None else _first(headers, SESSION_HEADERS)
    parent = _first(headers, PARENT_HEADERS)
    agent = _first(headers, AGENT_HEADERS)
    group = _first(headers, GROUP_HEADERS)
    if session is not None and session[1] == CLAUDE_CODE_SESSION.decode():
        # A Claude Code subagent's thread within its session: `{session}:{agent id}` (the root thread: the session).
        thread = usable(f"{session[0]}:{agent[0]}") if agent and agent[1] == CLAUDE_CODE_AGENT.decode() else None
        session = (thread, session[1]) if thread is not None else session
    return SessionKey(
        session[0] if session else None,
        session[1] if session else REQUEST_ID,
        parent[0] if parent else None,
        agent[0] if agent else None,
        group[0] if group else None,
        request_kind(headers.get(TURN_METADATA)),
    )


def side_request(kind: str | None) -> bool:
    """A request that is no turn of the thread's conversation (Codex's prewarm, compaction, memory): never continued
    and never continued from (docs/capture.md, Request kinds)."""
    return kind in SIDE_KINDS


def body_key(data: Any) -> tuple[str, str] | None:
    """(session id, source) from a body's `prompt_cache_key` or `metadata.user_id`; None: neither is usable."""
    if not isinstance(data, dict):
        return None
    value = usable(data.get(PROMPT_CACHE_KEY))
    if value is not None:
        return value, PROMPT_CACHE_KEY
    metadata = data.get("metadata")
    value = usable(metadata.get("user_id")) if isinstance(metadata, dict) else None
    return (value, METADATA_USER_ID) if value is not None else None


def session_key(raw_headers: Any, data: Any) -> SessionKey:
    """The key in the documented order: headers first, then the body's keys."""
    key = header_key(raw_headers)
    if key.session_id is not None:
        return key
    found = body_key(data)
    return key if found is None else key._replace(session_id=found[0], source=found[1])
