#!/usr/bin/env bash
# The embedded default (`make run`, after `make setup`): the admin user, the API principal "local"
# (its token kept in $VAR/local_token, mode 0600, the same at every start), the grant file; then
# device + gateway + Celery from the Procfile until Ctrl-C or SIGTERM (scripts/run_procfile.py,
# which also prints the URL and the token once the device answers). AOTX_VAR_DIR (default var)
# moves everything var/ holds, as it does for the gateway's settings. A stop asked for (Ctrl-C,
# SIGTERM, SIGHUP) that ends every process cleanly exits 0.
set -euo pipefail
umask 077  # what the run creates is its user's alone (each program also sets it: README "What runs")
cd "$(dirname "$0")/.."
VAR=${AOTX_VAR_DIR:-var}
PY=.venv/bin/python
echo "run: preparing the admin user, the principal \"local\" and the grant file ($VAR/)"
$PY manage.py local_setup --config "$VAR/gateway.json" --token-file "$VAR/local_token"
echo "run: starting device, gateway and celery (Ctrl-C stops them all)"
exec $PY scripts/run_procfile.py --procfile Procfile --config "$VAR/gateway.json" --token-file "$VAR/local_token"
