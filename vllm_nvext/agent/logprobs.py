"""The capture's logprobs on /v1/responses (VLLM_NVEXT_CAPTURE_LOGPROBS, docs/capture.md, Logprobs): what a
captured request that asked for none sends vLLM (`message.output_text.logprobs` added to its `include`), and
what is taken back out of the answer so the client gets what vLLM writes when not asked. Pure."""

from __future__ import annotations

import functools
from typing import Any

from .. import _json

OUTPUT_LOGPROBS = "message.output_text.logprobs"
# vLLM 0.32's `ResponsesRequest.include` entries (its Literal), read where vLLM's own model is not loaded.
_INCLUDE = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", OUTPUT_LOGPROBS, "reasoning.encrypted_content",
})  # fmt: skip
_DELTA = "response.output_text.delta"


@functools.cache
def _include_field() -> Any:
    """vLLM's own validator of `ResponsesRequest.include`, built once; None where vLLM is not loaded."""
    try:
        from pydantic import TypeAdapter
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    except ImportError:
        return None
    annotation: Any = ResponsesRequest.model_fields["include"].annotation
    return TypeAdapter(annotation)


def _valid_include(value: Any) -> bool:
    """Does vLLM's model take `value` as `include`: its own field where vLLM is loaded, else 0.32's Literal."""
    field = _include_field()
    if field is None:
        return isinstance(value, list) and all(isinstance(entry, str) and entry in _INCLUDE for entry in value)
    from pydantic import ValidationError

    try:
        field.validate_python(value)
    except ValidationError:
        return False
    return True


def include_with_logprobs(data: dict[str, Any]) -> str | None:
    """The encoded `include` that asks vLLM for the output text's logprobs, for a request that asked for none;
    None where it asked itself, or where adding it could change what vLLM decides or answers beyond them: an
    `include` vLLM refuses (its error stands), a `top_logprobs` of the client's other than 0 (it sizes what the
    engine computes, and past vLLM's --max-logprobs fails a request stock answers)."""
    include = data.get("include")
    if data.get("top_logprobs") not in (None, 0) or (include is not None and not _valid_include(include)):
        return None
    entries = list(include or ())
    if OUTPUT_LOGPROBS in entries:
        return None
    return _json.dumps_text([*entries, OUTPUT_LOGPROBS])


def _strip_part(part: Any) -> bool:
    """An `output_text` part's logprobs back to null, what vLLM writes when not asked (`[]` stays: it writes
    that for a part with no text yet, asked or not)."""
    if isinstance(part, dict) and part.get("type") == "output_text" and part.get("logprobs"):
        part["logprobs"] = None
        return True
    return False


def _strip_item(item: Any) -> bool:
    content = item.get("content") if isinstance(item, dict) else None
    changed = False
    for part in content if isinstance(content, list) else ():
        changed = _strip_part(part) or changed
    return changed


def strip_response(response: dict[str, Any]) -> bool:
    """A response object as vLLM writes it when not asked for logprobs: `top_logprobs` null (vLLM echoes its
    sampling's, set only with the include), each output text's `logprobs` null; True if it changed."""
    changed = False
    if response.get("top_logprobs") is not None:
        response["top_logprobs"] = None
        changed = True
    output = response.get("output")
    for item in output if isinstance(output, list) else ():
        changed = _strip_item(item) or changed
    return changed


def strip_event(obj: Any) -> bool:
    """One stream event as vLLM writes it when not asked: a text delta's `logprobs` `[]`, the response, part or
    item it carries stripped as above; True if it changed."""
    if not isinstance(obj, dict):
        return False
    changed = False
    if obj.get("type") == _DELTA and obj.get("logprobs"):
        obj["logprobs"] = []
        changed = True
    response = obj.get("response")
    if isinstance(response, dict):
        changed = strip_response(response) or changed
    return _strip_part(obj.get("part")) or _strip_item(obj.get("item")) or changed


# An event that may carry what `strip_event` takes out (inside a JSON string every quote is escaped).
STRIPPED_TOKENS = (b'"logprobs":[{', b'"top_logprobs":')
