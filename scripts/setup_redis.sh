#!/usr/bin/env bash
# Install Debian's redis-server for the capture store's tests (tests/support/redis_server.py starts
# one on a free port per test session); nothing to do when it is installed.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
command -v redis-server >/dev/null
