"""The capture's flags of `vllm-nvext serve` and `proxy` (docs/capture.md): their help, and the settings they make,
checked once at start-up (the store opened, a password on the command line warned about)."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

from ..capture.store import open_backend
from ..config import ConfigError, Settings

CAPTURE_HELP = (
    "record each request's token ids by session in this store: sqlite:////abs/path.sqlite3 or "
    "redis://host:port/db, its password in $VLLM_NVEXT_CAPTURE_PASSWORD or the file $VLLM_NVEXT_CAPTURE_PASSWORD_FILE "
    "names, never here (a command line is every local user's to read) (default $VLLM_NVEXT_CAPTURE; docs/capture.md)"
)
CAPTURE_API_HELP = (
    "who the read API /v1/nvext/sessions/{id} is served to: keyed (only behind the server's API key: a server without "
    "one does not serve it), open (also without a key: anyone who reaches the server), off (never; read the store "
    "with `vllm-nvext sessions export`) (default $VLLM_NVEXT_CAPTURE_API or keyed; docs/capture.md)"
)
PASSWORD_IN_ARGV = (
    "the store URL on the command line carries a password, which every user of this host reads in the process list; "
    "give it in VLLM_NVEXT_CAPTURE_PASSWORD, or in a file VLLM_NVEXT_CAPTURE_PASSWORD_FILE names (docs/capture.md)"
)
CONTINUE_IDS_HELP = (
    "a captured session's next prompt continues its last turn's exact ids (needs --capture; default "
    "$VLLM_NVEXT_CONTINUE_IDS; docs/capture.md)"
)
CAPTURE_LOGPROBS_HELP = (
    "a captured request asks vLLM for the sampled tokens' logprobs, so each turn records one per id; the client's "
    "answer stays as without it (needs --capture; default $VLLM_NVEXT_CAPTURE_LOGPROBS; docs/capture.md)"
)
CONTINUE_IDS_IN_PROXY = (
    "VLLM_NVEXT_CONTINUE_IDS=1 works only mounted in vLLM's server (`vllm-nvext serve --continue-ids`, "
    "--middleware or the plugin): the proxy cannot reach vLLM's chat rendering out of process (docs/capture.md)"
)


def warn_password_in_argv(command: str, url: str | None) -> None:
    """Say so where a store URL given on the command line carries a password (the process list shows it)."""
    try:
        password = urlsplit(url).password if url else None
    except ValueError:
        password = None
    if password:
        print(f"vllm-nvext {command}: warning: {PASSWORD_IN_ARGV}", file=sys.stderr, flush=True)


def capture_settings(
    command: str,
    url: str | None,
    capture_api: str | None,
    continue_ids: bool | None = None,
    capture_logprobs: bool | None = None,
) -> Settings | None:
    """The capture settings of `--capture URL` (else the environment's), the store opened once to check it."""
    warn_password_in_argv(command, url)
    try:
        settings = Settings.create(
            capture=url, capture_api=capture_api, continue_ids=continue_ids, capture_logprobs=capture_logprobs
        )
        if settings.capture is not None:
            open_backend(settings.capture).close()
    except ConfigError as exc:
        print(f"vllm-nvext {command}: error: {exc}", file=sys.stderr)
        return None
    return settings
