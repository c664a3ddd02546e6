"""vLLM's chat rendering, wrapped once at start-up when `VLLM_NVEXT_CONTINUE_IDS=1` (docs/capture.md
"Continuing the ids").

`OnlineRenderer.preprocess_chat` (vLLM 0.30-0.34) renders every chat, /v1/responses and /v1/messages
request with the chat template. The wrapper lets it render as always, then, for a request the capture
tap marked (`continuation.TURN`, set by capture/tap.py) and only there, swaps the prompt ids for the
previous turn's served ids + what is new (`continuation.continued`), where the answer the client sent back
renders, by vLLM's own rendering, to exactly what the served answer renders to (`renders_as_served`).
Everything vLLM does before and after (tool-choice checks, `adjust_request`, the length check, the engine)
runs on those ids as on its own. The splice runs in vLLM's tokenizer thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..config import ConfigError
from .continuation import ANSWER, LENGTH, TURN, Continuation, continued, enable

logger = logging.getLogger("vllm_nvext.capture")

# Where each vLLM renders a chat request: (module, class, method), the first found is wrapped.
TARGETS = (("vllm.renderers.online_renderer", "OnlineRenderer", "preprocess_chat"),)  # 0.30-0.34
_MARK = "_vllm_nvext_continues"
_STOPS: dict[int, frozenset[int]] = {}  # each renderer's stop ids (one per API-server process)
_REASONING: dict[int, Any] = {}  # each renderer's reasoning parser (None: the server runs none)
SEVERAL = "choices"  # the previous turn had n > 1 choices: which one does the client continue?
NOT_PLAIN = "not_plain"  # truncate_prompt_tokens, a multimodal or embeds prompt, Harmony, ids from the client


def install() -> None:
    """Wrap vLLM's chat rendering, once per process. ConfigError where vLLM or its renderer is not there."""
    for module_name, class_name, method in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        original = getattr(cls, method, None)
        if original is None:
            continue
        if not getattr(original, _MARK, False):
            setattr(cls, method, wrap(original))
        enable()
        return
    raise ConfigError(
        "continue_ids (VLLM_NVEXT_CONTINUE_IDS): this process has no vLLM chat renderer to continue ids in "
        "(vLLM 0.30-0.34's OnlineRenderer.preprocess_chat); it works inside vLLM's server only"
    )


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """`preprocess_chat` that continues the previous turn's ids where the request's tap asks for it."""

    @functools.wraps(original)
    async def preprocess_chat(self: Any, request: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        conversation, inputs = await original(self, request, messages, *args, **kwargs)
        turn = TURN.get()
        if turn is None or turn.used:
            return conversation, inputs  # not a captured request, or a later round of one (built-in tools)
        turn.used = True
        turn.messages = len(messages) if isinstance(messages, list) else None  # where the next turn's answer is
        if not turn.previous:
            return conversation, inputs

        async def render(edited: list[Any]) -> Any:  # vLLM's own rendering of other messages, the same request
            return (await original(self, request, edited, *args, **kwargs))[1]

        try:
            await _continue(self, request, turn, (messages, conversation, inputs), render)
        except Exception:  # vLLM's own rendering stands; a request never fails for this
            turn.outcome = "error"
            logger.exception("vllm-nvext: the previous turn's ids could not be continued")
        return conversation, inputs

    setattr(preprocess_chat, _MARK, True)
    return preprocess_chat


def _plain(renderer: Any, request: Any, conversation: Any, inputs: Any) -> bool:
    """A request whose prompt is vLLM's rendering of text alone, as the splice reads it."""
    if getattr(renderer, "use_harmony", False) or not conversation or not isinstance(inputs, list):
        return False  # Harmony (gpt-oss); no conversation: ids the client forwarded (decode-side reuse)
    if len(inputs) != 1 or getattr(request, "truncate_prompt_tokens", None) is not None:
        return False
    engine_input = inputs[0]
    return (
        isinstance(engine_input, dict)
        and engine_input.get("type", "token") == "token"
        and isinstance(engine_input.get("prompt_token_ids"), list)
        and not any(k in engine_input for k in ("multi_modal_data", "mm_kwargs", "prompt_embeds"))
    )


def stop_ids(renderer: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's EOS and the model's generation config's."""
    found: set[int] = set()
    values: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    with contextlib.suppress(Exception):  # no renderer (a test), no generation config: the tokenizer's
        values.append(renderer.model_config.try_get_generation_config().get("eos_token_id"))
    for value in values:
        for one in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(one, int) and not isinstance(one, bool):
                found.add(one)
    return frozenset(found)


def vllm_decode(app: Any) -> Callable[[Sequence[int]], str] | None:
    """vLLM's tokenizer in the server that runs `app` (`app.state.online_renderer`'s), ids to text with special
    tokens as they are (a break's texts); None outside a vLLM server (`vllm-nvext proxy`) or without one."""
    renderer = getattr(getattr(getattr(app, "state", None), "online_renderer", None), "renderer", None)
    try:
        tokenizer = None if renderer is None else renderer.get_tokenizer()
    except Exception:  # no tokenizer in this server (`--skip-tokenizer-init`)
        return None
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


def decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """Ids to the text a client gets (special tokens left out), as the splice compares answers."""

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


def _max_tokens(request: Any) -> int:
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 1


Check = Callable[[int | None, Sequence[str]], Awaitable[bool]]


async def renders_as_served(
    messages: Sequence[Any], rendered: Sequence[int], render: Callable[[list[Any]], Awaitable[Any]], at: int | None,
    texts: Sequence[str],
) -> bool:  # fmt: skip
    """Whether the client's answer (`messages[at]`, the message after the previous turn's history) renders, by
    vLLM's own template and tokenizer, to exactly what the served answer does: the request rendered again with
    `{"role": "assistant", "content": text}` in its place gives `rendered`, id for id, for one of `texts`. Any
    other message there (an edit of its text, whitespace alone included; a special token in its content or
    role; a head of the answer left out) falls back: the model then reads what the client sent."""
    if at is None or not 0 <= at < len(messages) or not isinstance(messages[at], Mapping):
        return False
    if messages[at].get("role") != "assistant":
        return False
    for text in texts:
        served = {"role": "assistant", "content": text}
        if dict(messages[at]) == served:
            return True  # the very message: the very rendering
        inputs = await render([*messages[:at], served, *messages[at + 1 :]])
        if isinstance(inputs, list) and len(inputs) == 1 and _ids(inputs[0]) == list(rendered):
            return True
    return False


def _ids(engine_input: Any) -> list[int] | None:
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
    return ids if isinstance(ids, list) else None


async def best(
    previous: Sequence[Any],
    rendered: list[int],
    stops: frozenset[int],
    decode: Callable[[Sequence[int]], str],
    check: Check,
    run: Callable[..., Awaitable[Any]],
) -> tuple[list[int] | None, str]:
    """The newest of the previous turns the new request continues: its ids, else why none (the newest's why).
    `run(f, *args)` runs the splice off the event loop; `check(at, texts)` is `renders_as_served`."""
    why: str | None = None
    for served in previous:
        prompt, completion, several, before, at = served
        if prompt is None or completion is None:
            continue
        if several:
            why = why or SEVERAL
            continue
        found, outcome = await run(continued, prompt, completion, rendered, stops, decode, before)
        if found is not None and await check(at, found.texts):
            return found.ids, outcome
        why = why or (ANSWER if found is not None else outcome)
    return None, why or "no_ids"


def _reasoning(renderer: Any, tokenizer: Any, request: Any) -> Callable[[str], str | None] | None:
    """The content vLLM's reasoning parser leaves of an answer's text (what the client got as its content), on a
    server that runs one; None on a server without."""
    key = id(renderer)
    if key not in _REASONING:
        cls = getattr(getattr(renderer, "parser", None), "reasoning_parser_cls", None)
        try:
            _REASONING[key] = None if cls is None else cls(tokenizer, model_config=renderer.model_config)
        except Exception:  # a parser this tokenizer cannot serve: no content is told apart
            _REASONING[key] = None
    parser = _REASONING[key]
    if parser is None:
        return None

    def content(text: str) -> str | None:
        try:
            found = parser.extract_reasoning(text, request)[1]
        except Exception:
            return None
        return found if isinstance(found, str) else None

    return content


async def _continue(renderer: Any, request: Any, turn: Continuation, chat: tuple[Any, Any, Any], render: Any) -> None:
    messages, conversation, inputs = chat
    if not _plain(renderer, request, conversation, inputs):
        turn.outcome = NOT_PLAIN
        return
    tokenizer = renderer.renderer.get_tokenizer()
    stops = _STOPS.get(id(renderer))
    if stops is None:  # read once per renderer: the generation config comes from the model's files
        stops = _STOPS[id(renderer)] = stop_ids(renderer, tokenizer)
    rendered: list[int] = inputs[0]["prompt_token_ids"]
    previous = [p.served() for p in turn.previous]  # read here, on the event loop that writes them
    turn.previous = []  # read once; older turns are not held by this request
    executor = getattr(renderer.renderer, "_executor", None)  # vLLM's tokenizer threads
    loop = asyncio.get_running_loop()
    content = _reasoning(renderer, tokenizer, request)

    async def run(function: Callable[..., Any], *args: Any) -> Any:
        return await loop.run_in_executor(executor, function, *args)

    async def check(at: int | None, texts: Sequence[str]) -> bool:
        # With a reasoning parser, the client got the answer's content apart from its reasoning.
        parsed = [c for t in texts if content is not None and (c := content(t)) is not None and c != t]
        return await renders_as_served(messages, rendered, render, at, [*texts, *parsed])

    ids, outcome = await best(previous, rendered, stops, decoder(tokenizer), check, run)
    limit = getattr(renderer.model_config, "max_model_len", None)
    longer = ids is not None and len(ids) > len(rendered)
    if longer and isinstance(limit, int) and len(ids or ()) + _max_tokens(request) > limit:
        ids, outcome = None, LENGTH  # vLLM's rendering fits where the continued ids would not
    turn.outcome = outcome
    if ids is not None:
        turn.rendered = rendered  # what the next turn's rendering is compared with
        inputs[0]["prompt_token_ids"] = ids
    else:
        logger.debug("vllm-nvext: a captured turn is not continued (%s): vLLM's own rendering", outcome)
