"""What the unit and end-to-end tests share: request bodies, reading answers, and comparing streams.

Streams are compared by what is deterministic (docs/protocol.md §7, docs/guarantees.md): vLLM merges
the outputs of several engine steps into one chunk whenever its API server lags the engine, so
chunk boundaries differ between two servers, and between two runs, by timing alone.
`stream_digest` is a stream with its chunking forgotten (concatenated deltas, ids, logprobs,
finish data, the usage chunk); `assert_stream_consistent` checks what each chunk must carry
relative to its own stream.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import tomllib

from vllm_nvext.protocol import PATHS, Endpoint

API_KEY = "nvext-test-key"
MODEL_NAME = "tiny"

CHAT, COMPLETIONS = PATHS[Endpoint.CHAT], PATHS[Endpoint.COMPLETIONS]
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6},
    COMPLETIONS: {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6},
}
DIALECTS: dict[str, dict[str, Any]] = {
    "vllm": {"return_token_ids": True},
    "nvext": {"nvext": {"extra_fields": ["completion_token_ids"]}},
    "both": {"return_token_ids": True, "nvext": {"extra_fields": ["completion_token_ids"]}},
}
MODES = ("auto", "vllm", "nvext", "both")
VOLATILE = ("id", "created")  # differ per request; everything else in an answer is compared


def greedy(path: str, **extra: Any) -> dict[str, Any]:
    return {**BASE[path], "temperature": 0, **extra}


def nvext(*selectors: str, **fields: Any) -> dict[str, Any]:
    return {"nvext": {"extra_fields": list(selectors), **fields}}


def nvext_placed(mode: str, dialect: str) -> bool:
    """Whether ids go under `nvext` for this mode and request dialect (docs/protocol.md §6)."""
    return mode in ("nvext", "both") or (mode == "auto" and dialect != "vllm")


# --- reading answers --------------------------------------------------------------------------


def sse_events(content: bytes, complete: bool = True) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, checking vLLM's framing: every event one `data: ` line, and
    (`complete`, a whole response) `[DONE]` last. `complete=False` reads what a reshaper sent for
    some events: the JSON events only, [DONE] or not."""
    if complete:
        assert content.endswith(b"data: [DONE]\n\n"), "stream must end with [DONE]"
    blocks = content.split(b"\n\n")[:-1]
    assert all(b.startswith(b"data: ") for b in blocks), "every event is one `data: ` line"
    return [json.loads(b[6:]) for b in blocks if b != b"data: [DONE]"]


def sse_frames(content: bytes) -> list[bytes]:
    """The JSON events of an SSE body as their frames' bytes (`data: {...}\\n\\n`), to feed a reshaper
    one event at a time; `[DONE]` is left out."""
    return [b + b"\n\n" for b in content.split(b"\n\n") if b.startswith(b"data: {")]


def http_client(url: str, auth: bool = True, timeout: float = 120.0) -> httpx.Client:
    """A client of the server at `url`, sending API_KEY (the key the test servers take) when `auth`."""
    headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
    return httpx.Client(base_url=url, headers=headers, timeout=timeout)


def websocket_refusal(url: str, path: str = "/v1/responses", auth: bool = True) -> tuple[int, bytes]:
    """What a real WebSocket client (`websockets`, as Codex opens one) is answered on `path`: the HTTP
    status and body that refused its handshake (AssertionError if the server accepts it)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
    try:
        with connect("ws" + url.removeprefix("http") + path, additional_headers=headers, open_timeout=30):
            pass
    except InvalidStatus as refused:
        return refused.response.status_code, bytes(refused.response.body or b"")
    raise AssertionError(f"the server accepted a WebSocket on {path}")


def post(client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """A unary body (its content-length checked), or a stream's JSON events; the status must be 200."""
    resp = client.post(path, json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        assert int(resp.headers["content-length"]) == len(resp.content)
        return resp.json()
    return sse_events(resp.content)


def strip_volatile(obj: Any) -> Any:
    if isinstance(obj, list):
        return [strip_volatile(o) for o in obj]
    return {k: v for k, v in obj.items() if k not in VOLATILE}


# The agent routes' fields that differ per request (/v1/responses and /v1/messages objects, at any depth).
AGENT_VOLATILE = frozenset({"id", "created_at", "created", "completed_at"})


def without_agent_volatile(obj: Any, volatile: frozenset[str] = AGENT_VOLATILE) -> Any:
    """`obj` without `volatile` keys at any depth: what two answers to one request share."""
    if isinstance(obj, list):
        return [without_agent_volatile(o, volatile) for o in obj]
    if isinstance(obj, dict):
        return {k: without_agent_volatile(v, volatile) for k, v in obj.items() if k not in volatile}
    return obj


def without_nvext(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "nvext"} for e in events]


def content_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks that carry choices (all but the usage-only chunk)."""
    return [e for e in events if e.get("choices")]


def final_event(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunk carrying the (first choice's) finish_reason."""
    return next(e for e in events if e.get("choices") and e["choices"][0]["finish_reason"] is not None)


def ids_of(path: str, answer: Any) -> tuple[list[int] | None, list[int]]:
    """(prompt ids, completion ids of choice 0) from an answer in vLLM placement, unary or streamed."""
    events = answer if isinstance(answer, list) else [answer]
    prompt: list[int] | None = None
    ids: list[int] = []
    for event in events:
        if path == CHAT and event.get("prompt_token_ids"):
            prompt = prompt or event["prompt_token_ids"]
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            if path == COMPLETIONS and choice.get("prompt_token_ids"):
                prompt = prompt or choice["prompt_token_ids"]
    return prompt, ids


def nvext_stream_ids(events: list[dict[str, Any]]) -> list[int]:
    """A stream's completion ids concatenated over its chunks' `nvext.completion_token_ids`."""
    return [i for e in content_events(events) for i in e["nvext"]["completion_token_ids"]]


def logprob_values(path: str, choice: dict[str, Any]) -> list[float]:
    if path == CHAT:
        return [c["logprob"] for c in choice["logprobs"]["content"]]
    return choice["logprobs"]["token_logprobs"]


# --- comparing streams ------------------------------------------------------------------------

# Keys whose values a stream spreads over its chunks (and everything below them): deltas, ids,
# logprobs, and what is sent once (prompt ids, finish data). Every other key repeats per chunk.
CONCATENATED = frozenset({"delta", "text", "token_ids", "prompt_token_ids", "logprobs", "finish_reason", "stop_reason"})


def _leaves(obj: dict[str, Any], prefix: str, concatenated: bool) -> Iterator[tuple[str, Any, bool]]:
    for key, value in obj.items():
        if not prefix and key in VOLATILE:
            continue
        path, concat = f"{prefix}{key}", concatenated or key in CONCATENATED
        if key == "choices" and not prefix:
            for choice in value:
                yield from _leaves(choice, f"choices[{choice['index']}].", False)
        elif isinstance(value, dict):
            yield f"{path}{{}}", None, False  # the key is there, even when the dict is empty
            yield from _leaves(value, f"{path}.", concat)
        else:
            yield path, value, concat


def stream_digest(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream with its chunking forgotten, to compare streams from different servers or runs.

    Keys spread over chunks (`CONCATENATED`, at any depth below them) map to their values
    concatenated over the chunks (strings and lists; `None` where a chunk sends `null`); every
    other key maps to the list of its distinct non-null values. The usage-only chunks are kept
    whole, less `id` and `created`.
    """
    spread: dict[str, Any] = {}
    repeated: dict[str, list[Any]] = {}
    for event in content_events(events):
        for path, value, concat in _leaves(event, "", False):
            if concat and value is None:
                spread.setdefault(path, None)
            elif concat and isinstance(value, (str, list)):
                spread[path] = value if spread.get(path) is None else spread[path] + value
            else:
                seen = repeated.setdefault(path, [])
                if value is not None and value not in seen:
                    seen.append(value)
    # A `null` where other chunks send an object (chat's role chunk: `"logprobs": null`; 0.33's
    # `kv_transfer_params` before the finish chunk) says nothing once chunks merge.
    spread = {path: v for path, v in spread.items() if v is not None or f"{path}{{}}" not in repeated}
    repeated = {path: seen for path, seen in repeated.items() if seen or f"{path}{{}}" not in repeated}
    digest: dict[str, Any] = {**spread, **{f"{path} (values)": seen for path, seen in repeated.items()}}
    digest["usage-only chunks"] = strip_volatile([e for e in events if not e.get("choices")])
    return digest


_ID_KEYS = ("token_ids", "prompt_token_ids")


def ids_as_null(events: list[dict[str, Any]], with_ids: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream answered without ids, with each id key that the answer with ids carries (at the root, or in
    a choice) written as null on every chunk with choices where it is missing: what vllm-nvext answers when
    it asked for the ids and moved them to `nvext` (its copies set back to null, docs/protocol.md §6).
    vLLM's Python server writes those nulls itself; vllm-rs leaves the keys out. Chunking-independent
    under `stream_digest`."""
    root = {k for e in content_events(with_ids) for k in _ID_KEYS if k in e}
    choice = {k for e in content_events(with_ids) for c in e["choices"] for k in _ID_KEYS if k in c}
    out: list[dict[str, Any]] = json.loads(json.dumps(events))
    for event in content_events(out):
        event.update({k: None for k in root if k not in event})
        for c in event["choices"]:
            c.update({k: None for k in choice if k not in c})
    return out


def assert_stream_consistent(path: str, events: list[dict[str, Any]], usage: bool = True) -> None:
    """What each chunk of one stream must carry relative to its own stream, whatever its chunking."""
    assert events, "a stream has chunks"
    for key in ("id", "created", "model", "object"):
        assert len({json.dumps(e.get(key)) for e in events}) == 1, f"one {key} for every chunk of a stream"
    content = content_events(events)
    if usage:
        assert not events[-1]["choices"] and events[-1]["usage"], "the usage-only chunk comes last"
        assert len(content) == len(events) - 1, "one usage-only chunk"
    indices = {c["index"] for e in content for c in e["choices"]}
    for index in indices:
        own = [c for e in content for c in e["choices"] if c["index"] == index]
        finishes = [i for i, c in enumerate(own) if c.get("finish_reason") is not None]  # vllm-rs omits a null one
        assert finishes == [len(own) - 1], "a finish_reason on the choice's last chunk only"
    # vLLM placement (docs/protocol.md §1): prompt ids on the first chunk only; none later.
    if path == CHAT:
        assert all("prompt_token_ids" not in e for e in content[1:]), "chat: prompt ids on the first chunk only"
    else:
        later = [c.get("prompt_token_ids") for e in content[1:] for c in e["choices"]]
        assert not any(later), "completions: prompt ids on a choice's first chunk only"


def assert_nvext_chunks(events: list[dict[str, Any]], prompt: list[int], ids: list[int], both: bool) -> None:
    """`nvext` on a stream (docs/protocol.md §7): each chunk's own delta ids, prompt ids on the finish chunk
    only, nothing on the usage-only chunk; with `both`, each chunk's nvext ids are its `token_ids`."""
    for event in events:
        if not event["choices"]:
            assert "nvext" not in event, "no nvext on the usage-only chunk"
            continue
        nv = event["nvext"]
        if both:
            assert nv["completion_token_ids"] == (event["choices"][0].get("token_ids") or []), (
                "a chunk's nvext.completion_token_ids are that chunk's own delta ids"
            )
        if event["choices"][0].get("finish_reason") is None:  # vllm-rs omits a null one
            assert set(nv) == {"completion_token_ids"}, "prompt ids on the finish chunk only"
        else:
            assert nv["prompt_token_ids"] == prompt
    assert nvext_stream_ids(events) == ids


# --- the parity command ------------------------------------------------------------------------


def run_parity(*argv: str) -> tuple[int, str, str, dict[str, Any] | None]:
    """Parse argv as the CLI does, run parity; (exit status, table, progress, JSON report)."""
    from vllm_nvext.tools import cli, parity

    args = cli.build_parser().parse_args(["parity", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = parity.run(args, stdout=out, stderr=err)
    report = None
    if args.json_report is not None and args.json_report.exists():
        report = json.loads(args.json_report.read_text())
    return status, out.getvalue(), err.getvalue(), report


def rows(table: str, check: str) -> list[str]:
    """The lines of a parity table for one check."""
    return [line for line in table.splitlines() if f"  {check}  " in line]


# An editing proxy in front of a server.

FORWARDED_HEADERS = ("authorization", "content-type", "x-nvext-mode")
# (path, request, status, content type, body) -> (status, body)
Edit = Callable[[str, dict[str, Any], int, str, bytes], tuple[int, bytes]]


@contextmanager
def proxy(upstream: str, edit: Edit) -> Iterator[str]:
    """An HTTP proxy in a thread: forwards to `upstream`, lets `edit` change POST answers."""
    http = httpx.Client(base_url=upstream, timeout=120.0)

    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
            upstream_response = http.request(self.command, self.path, content=body or None, headers=headers)
            status, content = upstream_response.status_code, upstream_response.content
            content_type = upstream_response.headers.get("content-type", "application/json")
            if self.command == "POST":
                status, content = edit(self.path, json.loads(body), status, content_type, content)
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = _forward

        def log_message(self, *args: Any) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        http.close()


def general_plugin_dist(folder: Path) -> Path:
    """`folder`, holding an installed distribution's metadata with pyproject.toml's `vllm.general_plugins`
    entry points: on PYTHONPATH, vLLM's plugin loader finds them as it would once the package is installed."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    group = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["vllm.general_plugins"]
    dist = folder / "vllm_nvext_entry_points-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-nvext-entry-points\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in group.items())
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return folder
