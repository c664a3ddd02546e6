"""Where vllm-nvext's answers still differ from a real NVIDIA Dynamo 1.6.1, and why.

This list is the contract for Dynamo compatibility: the conformance tests
(tests/e2e/test_dynamo_conformance.py) send the same requests to a real Dynamo 1.6.1 and to
vllm-nvext and fail on any difference not listed here; the table of docs/dynamo-differences.md
shows exactly these entries. Each entry says what differs, which side is the
contract, why, and as data, for which requests and which `nvext` keys it holds, so that a
comparison (the tests, a migration check) can set exactly those keys aside and compare the rest.

`when` conditions on the request body (all must hold):
  selectors: nvext.extra_fields includes all of these;  not_selectors: none of these;
  any_selectors: at least one of these;  stream: bool;  several_choices: n > 1 or a completions batch (bool);
  stop_string: a `stop` string is set (bool);  batch: a completions batch (bool);
  usage_reports: a one-choice stream with `stream_options.include_usage` (vLLM's usage chunk
  follows the finish chunk, which waits for it) (bool);
  root: the body has all of these root keys;
  other_route: the difference is about routes other than chat and completions, whose bodies are
  the ones compared here (so it never holds for one of them) (bool).
`dynamo_only` / `nvext_only`: `nvext` key paths (dotted, e.g. `engine_data.kv_cache_hit`) that
only that side writes under those conditions (or, named on both sides, that one side writes only
some of the time), set aside on that side before the answers are compared. `aspects`: other
compared aspects that may differ (`status`, `error_shape`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol import COMPLETION_TOKEN_IDS, ENGINE_DATA, PROMPT_LOGPROBS, PROMPT_TOKEN_IDS, WORKER_ID

DYNAMO_VERSION = "1.6.1"


@dataclass(frozen=True)
class Difference:
    id: str
    what: str  # the difference, as the docs table states it
    contract: str  # which side is the contract
    reason: str  # why vllm-nvext differs
    when: Mapping[str, Any] = field(default_factory=dict)
    dynamo_only: tuple[str, ...] = ()
    nvext_only: tuple[str, ...] = ()
    aspects: tuple[str, ...] = ()

    def applies(self, body: Mapping[str, Any]) -> bool:
        """Whether this difference holds for a request with this JSON body."""
        nvext = body.get("nvext")
        selected = nvext.get("extra_fields") if isinstance(nvext, dict) else None
        extra: list[Any] = selected if isinstance(selected, list) else []
        batch = _is_batch(body.get("prompt"))
        several = (isinstance(body.get("n"), int) and body["n"] > 1) or batch
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        facts = {
            "stream": bool(body.get("stream")),
            "several_choices": several,
            "stop_string": bool(body.get("stop")),
            "batch": batch,
            "usage_reports": bool(body.get("stream")) and include_usage and not several,
            "other_route": False,
        }
        for key, want in self.when.items():
            if key == "selectors":
                ok = all(s in extra for s in want)
            elif key == "not_selectors":
                ok = not any(s in extra for s in want)
            elif key == "any_selectors":
                ok = any(s in extra for s in want)
            elif key == "root":
                ok = all(k in body for k in want)
            elif key in facts:
                ok = facts[key] == want
            else:
                raise ValueError(f"{self.id}: unknown condition {key!r}")
            if not ok:
                return False
        return True


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        id="token-id-trio",
        what=(
            "`completion_token_ids` also returns `prompt_token_ids` and `kv_transfer_params` under "
            "`nvext` (finish chunk / unary), and `return_token_ids: true` is accepted as its alias"
        ),
        contract="vllm-nvext (Dynamo PR #13588)",
        reason=(
            "This project's purpose: the token-id trio of the open Dynamo PR #13588. Dynamo 1.6.1 "
            "answers only the ids and refuses `return_token_ids` with 400"
        ),
        when={"selectors": [COMPLETION_TOKEN_IDS], "not_selectors": [PROMPT_TOKEN_IDS]},
        nvext_only=(PROMPT_TOKEN_IDS, "kv_transfer_params"),
    ),
    Difference(
        id="stop-string-engine-data",
        what="`engine_data` is answered on every stop-string finish",
        contract="vllm-nvext",
        reason=(
            "Dynamo 1.6.1's frontend matches stop strings itself and cancels its worker, so its "
            "`engine_data` is lost whenever the cancel beats the worker's final chunk; when the chunk "
            "wins the race (a loaded frontend), Dynamo answers it with the ids generated past the stop "
            "string. vLLM finishes the request itself and always reports the ids it returned"
        ),
        when={"stop_string": True, "any_selectors": [ENGINE_DATA]},
        # Set aside on both sides: Dynamo writes it or not by that race.
        dynamo_only=(ENGINE_DATA,),
        nvext_only=(ENGINE_DATA,),
    ),
    Difference(
        id="stop-string-unary-order",
        what=(
            "A unary answer that a stop string ended writes its `nvext` keys in Dynamo's unary order "
            "(`completion_token_ids` first) every time"
        ),
        contract="vllm-nvext",
        reason=(
            "Dynamo 1.6.1's unary answer keeps the `nvext` of the last chunk it saw: its own "
            "(`completion_token_ids` first) when its stop-string cancel beats the worker's final chunk, "
            "the worker's finish-chunk order (`timing` first) when that chunk wins the race. Which keys "
            "are written, and their values, are compared as ever"
        ),
        when={"stop_string": True, "stream": False},
        aspects=("nvext.keys",),
    ),
    Difference(
        id="stream-engine-metrics",
        what=(
            "In streams without `stream_options.include_usage` (or with n > 1), `timing` has no "
            "`prefill_wait_time_ms`/`prefill_time_ms` (`ttft_ms` is the middleware's clock at the "
            "first token) and `engine_data` has no `kv_cache_hit`"
        ),
        contract="Dynamo 1.6.1",
        reason=(
            "vLLM reports its per-request metrics and cached-token count only on the usage chunk, "
            "for one choice; the finish chunk waits for that chunk when it comes (the client asked "
            "for usage), and no value is invented when it does not"
        ),
        when={"stream": True, "usage_reports": False},
        dynamo_only=("timing.prefill_wait_time_ms", "timing.prefill_time_ms", "engine_data.kv_cache_hit"),
    ),
    Difference(
        id="several-choices-metrics",
        what="With n > 1 or a completions batch, unary `timing` has only `request_received_ms` and `total_time_ms`",
        contract="Dynamo 1.6.1",
        reason="vLLM reports no per-request metrics for several choices; no value is invented",
        when={"several_choices": True, "stream": False},
        dynamo_only=("timing.prefill_wait_time_ms", "timing.prefill_time_ms", "timing.ttft_ms"),
    ),
    Difference(
        id="server-reported-values",
        what=(
            "`timing.prefill_wait_time_ms`/`prefill_time_ms` (and unary `ttft_ms`) need vLLM's "
            "`--enable-per-request-metrics`; `engine_data.kv_cache_hit` needs "
            "`--enable-prompt-tokens-details`"
        ),
        contract="Dynamo 1.6.1",
        reason="They are vLLM's own measurements; without those flags vLLM reports none, and none is invented",
    ),
    Difference(
        id="worker-id",
        what="`worker_id` is not answered",
        contract="Dynamo 1.6.1",
        reason="A single `vllm serve` has no Dynamo router and no worker ids to report",
        when={"selectors": [WORKER_ID]},
        dynamo_only=(WORKER_ID,),
    ),
    Difference(
        id="batch-prompt-selectors",
        what=("A completions batch with `prompt_token_ids`, `engine_data` or `prompt_logprobs` is refused with 400"),
        contract="vllm-nvext",
        reason=(
            "Dynamo documents these selectors as single-prompt; 1.6.1 answers 200 with only the "
            "last prompt's ids, which a client cannot tell from a right answer"
        ),
        when={"batch": True, "any_selectors": [PROMPT_TOKEN_IDS, ENGINE_DATA, PROMPT_LOGPROBS]},
        aspects=("status",),
    ),
    Difference(
        id="greed-sampling",
        what="`greed_sampling: true` samples greedily (temperature 0)",
        contract="vllm-nvext",
        reason=(
            "Dynamo 1.6.1's frontend drops `temperature`/`top_p` for it, so its vLLM worker samples "
            "at temperature 1.0: an accident, not its contract"
        ),
    ),
    Difference(
        id="include-reasoning",
        what=(
            "`include_reasoning` is accepted; where vLLM then withholds the ids (a server with a reasoning "
            "or tool parser), `completion_token_ids` and `engine_data.completion_token_ids` are `null`"
        ),
        contract="vLLM",
        reason=(
            "Dynamo 1.6.1 refuses `include_reasoning` (400), as it refuses every root field it does not "
            "know; vLLM hides the ids so that they cannot leak the hidden reasoning, and `null` says "
            '"not reported" where `[]` would claim no tokens'
        ),
        when={"root": ["include_reasoning"]},
        aspects=("status",),
    ),
    Difference(
        id="echo",
        what="Completions `echo` returns the prompt in front of `text`; chat `echo` is served",
        contract="vLLM",
        reason=(
            "Dynamo 1.6.1 ignores completions `echo` (no prompt in `text`) and refuses chat `echo` (400); "
            "the server is vLLM, whose clients rely on its echo"
        ),
        when={"root": ["echo"]},
        aspects=("status",),
    ),
    Difference(
        id="routes",
        what="`nvext` is answered on vLLM's `/v1/chat/completions/batch` and `/invocations` too",
        contract="vllm-nvext",
        reason="Dynamo 1.6.1 has no batch or SageMaker route (404) (docs/protocol.md §10)",
        when={"other_route": True},
    ),
    Difference(
        id="agent-routes",
        what=(
            'On `/v1/responses`, `nvext.extra_fields: ["completion_token_ids"]` is answered (a root '
            "`nvext` with the ids and `prompt_token_ids`, in a stream on the `response` of the last event) "
            "and `return_token_ids: true` as vLLM's `input_messages` / `output_messages` with `tokens`; "
            "selectors other than the two id selectors are refused (400). On `/v1/messages` both are "
            "answered through the plugin mount (the `--middleware` mount alone refuses them, 400)"
        ),
        contract="vllm-nvext",
        reason=(
            "Measured on Dynamo 1.6.1 (tests/e2e/test_dynamo_conformance.py): on `/v1/responses` it refuses "
            '`completion_token_ids` with 501 `Not Implemented` ("not supported by the Responses API"), '
            "unary and streamed, answers `return_token_ids: true` with 200 and no ids, and answers "
            "`prompt_token_ids`, `timing` and `worker_id` in a unary root `nvext`; its `/v1/messages` "
            "(frontend `--enable-anthropic-api`, experimental) answers 200 with no `nvext` and no ids "
            "whatever is asked, unary and streamed. A request that asks for nothing gets no `nvext` from "
            "either server. Agent harnesses train on these routes, which need every sampled id "
            "(docs/protocol.md §11)"
        ),
        when={"other_route": True},
    ),
    Difference(
        id="error-envelope",
        what='Errors use vLLM\'s envelope `{"error": {message, type, param, code}}` (same HTTP status)',
        contract="vLLM",
        reason="The server is vLLM: its clients read vLLM's envelope; Dynamo's is flat `{message, type, code}`",
        aspects=("error_shape",),
    ),
)


def find(body: Mapping[str, Any]) -> list[Difference]:
    """The differences that hold for a request with this body."""
    return [d for d in DIFFERENCES if d.applies(body)]


def readme_table() -> str:
    """The table of docs/dynamo-differences.md, generated from this list."""
    rows = ["| difference | contract | why |", "|---|---|---|"]
    rows += [f"| {d.what} | {d.contract} | {d.reason} |" for d in DIFFERENCES]
    return "\n".join(rows)
