#!/usr/bin/env bash
# Install the real agent CLIs the client e2e group drives (tests/e2e/test_real_clients.py), pinned, from the
# npm registry, outside the repository:
#   "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/agent-clis-<codex>-<claude-code>"
# Codex CLI (`@openai/codex`) and Claude Code (`@anthropic-ai/claude-code`), unmodified; each ships its
# native binary as an npm package of its platform (Claude Code's postinstall links it). Bumping a version:
# CONTRIBUTING.md, "The real agent CLIs". Idempotent: a complete install is marked by a stamp written
# last, and reused. Prints the folder of the two executables (`codex`, `claude`) on its last line.
set -euo pipefail
CODEX_VERSION=0.169.0
CLAUDE_CODE_VERSION=2.1.328
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/agent-clis-$CODEX_VERSION-$CLAUDE_CODE_VERSION"
STAMP="$VENV/.setup-stamp"

if [ ! -f "$STAMP" ]; then
  command -v npm >/dev/null 2>&1 || { echo "setup-clis: npm (Node.js 20 or newer) is needed" >&2; exit 1; }
  start=$(date +%s)
  echo "setup-clis: installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$VENV"
  npm install --prefix "$VENV" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2
  got_codex=$("$VENV/node_modules/.bin/codex" --version)
  got_claude=$("$VENV/node_modules/.bin/claude" --version)
  case "$got_codex" in *" $CODEX_VERSION") ;; *) echo "setup-clis: codex says '$got_codex'" >&2; exit 1 ;; esac
  case "$got_claude" in "$CLAUDE_CODE_VERSION "*) ;; *) echo "setup-clis: claude says '$got_claude'" >&2; exit 1 ;; esac
  echo "setup-clis: $got_codex, $got_claude in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
  touch "$STAMP"
fi
echo "$VENV/node_modules/.bin"
