"""Offline hidden-state capture, the way speculators drives a vLLM server (docs/protocol.md §2 and §4).

Each prompt goes to `/v1/completions` as token ids with `max_tokens: 1` and
`return_token_ids: true`; the answer's prompt ids must equal the sent ids, and
`kv_transfer_params.hidden_states_path` names the safetensors file the connector writes.
The script waits on the writer's `<path>.lock`, loads the file with
`vllm_nvext.hidden_states.load` and checks its tensors. A chat request checks the same for a
templated prompt. With `--out DIR` the files are moved there, as speculators does.

The server needs a hidden-states connector; on CPU use the package's own::

    vllm-nvext serve -- \\
      --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}}' \\
      --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "vllm_nvext.connectors.hidden_states", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/hidden_states"}}'
    python examples/hidden_states_capture.py [--url URL] [--model NAME] [--api-key KEY] [--out DIR]

Run it on the server's host (the files are on its disk). Exit status 0 when every check
passes, 1 when one fails, 2 when the server has no hidden-states connector or is unreachable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import httpx

from vllm_nvext import hidden_states
from vllm_nvext.client import TokenIds, TokenIdsError, extract, first_difference

PROMPTS = (
    [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
    [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
    [49, 50, 51],
)
NO_CONNECTOR = (
    "{url} returned no kv_transfer_params.hidden_states_path: the server runs without a hidden-states "
    "connector. Start it with --speculative-config and --kv-transfer-config as this script's docstring shows."
)


def capture(http: httpx.Client, url: str, body: dict, path: str) -> TokenIds:
    response = http.post(url + path, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{path} answered HTTP {response.status_code}: {response.text[:300]}")
    return extract(response.json())


def check_file(ids: TokenIds, sent: list[int] | None, out: Path | None) -> list[str]:
    """Problems with one captured request; an empty list means it passed."""
    problems = []
    if sent is not None and (diff := first_difference(ids.prompt_token_ids, sent)) is not None:
        problems.append(f"returned prompt ids differ from the sent ids: {diff}")
    path = (ids.kv_transfer_params or {}).get("hidden_states_path")
    try:
        hs = hidden_states.load(path, expect_token_ids=ids.prompt_token_ids, timeout=60.0)
    except hidden_states.HiddenStatesError as exc:
        return [*problems, str(exc)]
    shape = tuple(hs.hidden_states.shape)
    print(f"  {path}: hidden_states {list(shape)} {hs.hidden_states.dtype}, {hs.num_tokens} token ids")
    num_prompt = len(ids.prompt_token_ids or ())
    if shape != (num_prompt, hs.num_layers, hs.hidden_size):
        problems.append(f"hidden_states shape {list(shape)} does not match {num_prompt} prompt ids")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(path, out / Path(path).name)
        Path(path + ".lock").unlink(missing_ok=True)
        print(f"  moved to {out / Path(path).name}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    parser.add_argument("--out", type=Path, help="move the captured files into this directory")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    requests: list[tuple[str, dict, list[int] | None]] = [
        ("/v1/completions", {"prompt": ids, "max_tokens": 1, "return_token_ids": True}, ids) for ids in PROMPTS
    ]
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "return_token_ids": True}
    requests.append(("/v1/chat/completions", chat, None))

    failures = 0
    with httpx.Client(headers=headers, timeout=120.0) as http:
        for number, (path, body, sent) in enumerate(requests, 1):
            try:
                ids = capture(http, url, {"model": args.model, "temperature": 0, **body}, path)
            except httpx.HTTPError as exc:
                print(f"cannot reach {url}: {exc}", file=sys.stderr)
                return 2
            except (RuntimeError, TokenIdsError) as exc:
                print(f"request {number} ({path}): FAIL {exc}")
                failures += 1
                continue
            params = ids.kv_transfer_params or {}
            if params.get("hidden_states_error"):  # the connector refused this capture; the server is fine
                print(f"request {number} ({path}): FAIL {params['hidden_states_error']}")
                failures += 1
                continue
            if not params.get("hidden_states_path"):
                print(NO_CONNECTOR.format(url=url), file=sys.stderr)
                return 2
            print(f"request {number} ({path}): {len(ids.prompt_token_ids or ())} prompt ids")
            for problem in check_file(ids, sent, args.out):
                print(f"  FAIL {problem}")
                failures += 1
    print("all hidden-state files check out" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
