#!/usr/bin/env bash
# Writes $VAR/gateway.json (VAR: AOTX_VAR_DIR, default var) for the embedded default, unless one
# exists: listen on 127.0.0.1:${AOTX_PORT:-8000}. To change the port later, edit "listen" in it.
set -euo pipefail
umask 077  # var/ (0700) and gateway.json (0600): their user's alone, as everything under var/
cd "$(dirname "$0")/.."
var=${AOTX_VAR_DIR:-var}
case $var in /*) ;; *) var="$(pwd)/$var" ;; esac
mkdir -p "$var"
if [ ! -f "$var/gateway.json" ]; then
  cat > "$var/gateway.json" <<JSON
{"listen": "127.0.0.1:${AOTX_PORT:-8000}", "socket": "$var/journal/service.sock", "grants_file": "$var/grants.json", "workers": $(nproc)}
JSON
fi
