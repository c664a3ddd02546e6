#!/usr/bin/env bash
# Run `vllm-nvext parity` against a running vllm-nvext server and keep a JSON report.
#
#   vllm-nvext serve &                                   # the tiny model on http://127.0.0.1:8000
#   examples/parity.sh [--url URL] [--api-key KEY] [any other `vllm-nvext parity` option]
#
# Compare against a stock vLLM instead of the server's own vLLM dialect:
#   examples/parity.sh --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001
#
# The report goes to $PARITY_REPORT (default ./parity-report.json). The exit status is the
# command's: 0 all checks passed, 1 a check or request failed, 2 usage error or unreachable server.
set -euo pipefail

report="${PARITY_REPORT:-parity-report.json}"
args=("$@")
has_url=0
for arg in "${args[@]+"${args[@]}"}"; do
  [[ "$arg" == --url || "$arg" == --url=* ]] && has_url=1
done
if [[ $has_url == 0 ]]; then
  args=(--url "${VLLM_NVEXT_URL:-http://127.0.0.1:8000}" "${args[@]+"${args[@]}"}")
fi

if command -v vllm-nvext >/dev/null 2>&1; then
  cmd=(vllm-nvext)
else  # not on PATH (e.g. an inactive virtualenv): use the interpreter that has the package
  cmd=("${PYTHON:-python3}" -m vllm_nvext.tools.cli)
fi

status=0
"${cmd[@]}" parity --json "$report" "${args[@]}" || status=$?
if [[ $status == 0 ]]; then
  echo "parity: all checks passed; report in $report"
elif [[ $status == 1 ]]; then
  echo "parity: some checks FAILED; see the table above and $report" >&2
fi
exit "$status"
