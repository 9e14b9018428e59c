#!/usr/bin/env bash
# Writes var/gateway.json for the embedded default, unless one exists.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if [ ! -f var/gateway.json ]; then
  cat > var/gateway.json <<JSON
{"listen": "127.0.0.1:${AOTX_PORT:-8000}", "socket": "$root/var/journal/service.sock", "grants_file": "$root/var/grants.json"}
JSON
fi
