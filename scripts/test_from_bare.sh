#!/usr/bin/env bash
# `make test` as a new machine runs it (`make test-from-bare`): a fresh clone of this checkout's HEAD,
# a fresh HOME (so no pip, uv, vLLM compile or tiny-model cache) and so a fresh VLLM_NVEXT_REFS, all in one
# temporary directory, removed afterwards unless KEEP=1. Every line of the run's output is logged with the
# seconds since the start; the breakdown printed at the end (and kept in the log) is read off that log:
# when the set-up ended, how long each reference venv took, and when each pytest run ended.
# Fails when `make test` fails, and when it took more than LIMIT_MIN minutes (60 by default: CI's
# budget is 90, and a slower machine must still fit).
# Usage: make test-from-bare [KEEP=1] [LIMIT_MIN=60] [BARE_DIR=/somewhere/with/45-GB/free]
#        bash scripts/test_from_bare.sh --breakdown LOG   (the breakdown of a kept log)
set -uo pipefail
# The lines that say when a phase ended (two jobs share the output, so one may sit mid-line): the set-up, each
# reference venv, each pytest run's summary; each with the seconds since the start its line was logged at.
breakdown() {
  awk '{
    t = $1; line = $0
    while (match(line, /(setup: vllm [^ ]+ [+] vllm-nvext [^ ]+|setup-[a-z-]+: done in [0-9]+ s|[0-9]+ (passed|failed)[^=]* in [0-9.]+s( [(][0-9:]+[)])?)/)) {
      printf "%6d s  %s\n", t, substr(line, RSTART, RLENGTH)
      line = substr(line, RSTART + RLENGTH)
    }
  }' "$1"
}
[ "${1:-}" = "--breakdown" ] && { breakdown "$2"; exit 0; }
REPO="$(cd "$(dirname "$0")/.." && pwd)"
LIMIT_MIN="${LIMIT_MIN:-60}"
BARE="$(mktemp -d "${BARE_DIR:-${TMPDIR:-/tmp}}/vllm-nvext-bare.XXXXXX")"
LOG="$BARE/make-test.log"
echo "test-from-bare: a fresh clone of $(git -C "$REPO" rev-parse --short HEAD) in $BARE/repo, HOME=$BARE/home"
git clone --quiet --no-hardlinks "$REPO" "$BARE/repo"
mkdir -p "$BARE/home"
# HOME moves every cache that lives under it (pip's, uv's, vLLM's, ~/.cache/vllm-nvext with its reference
# venvs and tiny model); the interpreter itself (pyenv's root, if any) stays where it is installed.
export PYENV_ROOT="${PYENV_ROOT:-$HOME/.pyenv}"
start=$SECONDS
(
  cd "$BARE/repo" &&
    env -u VLLM_NVEXT_REFS -u XDG_CACHE_HOME -u PIP_CACHE_DIR -u UV_CACHE_DIR -u VLLM_CACHE_ROOT \
      HOME="$BARE/home" make test 2>&1
) | while IFS= read -r line; do printf '%5d %s\n' "$((SECONDS - start))" "$line"; done | tee "$LOG"
status=${PIPESTATUS[0]}
total=$((SECONDS - start))

{
  echo
  echo "test-from-bare: where the minutes went (seconds since the start: what ended then)"
  breakdown "$LOG"
  printf 'test-from-bare: make test exited %s after %d min %02d s (limit %s min)\n' \
    "$status" $((total / 60)) $((total % 60)) "$LIMIT_MIN"
} | tee -a "$LOG"
if [ "${KEEP:-0}" = 1 ]; then
  echo "test-from-bare: kept $BARE (log: $LOG)"
else
  cp "$LOG" "$REPO/build-from-bare.log" 2>/dev/null || true
  rm -rf "$BARE"
  echo "test-from-bare: removed $BARE; the log is $REPO/build-from-bare.log"
fi
[ "$status" = 0 ] || exit "$status"
[ "$total" -le $((LIMIT_MIN * 60)) ] || { echo "test-from-bare: over $LIMIT_MIN minutes" >&2; exit 1; }
