#!/usr/bin/env bash
# The embedded default: one admin user, one API principal "local" (its token is re-issued and
# printed at every start), the grant file, then device + gateway + Celery under honcho.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CONFIG=var/gateway.json
$PY manage.py shell -c '
import secrets
from django.contrib.auth import get_user_model
User = get_user_model()
if not User.objects.filter(username="admin").exists():
    password = secrets.token_urlsafe(12)
    User.objects.create_superuser("admin", "", password)
    print(f"admin console user: admin / {password}  (shown once)")
'
if $PY manage.py principal list | grep -q "^local	"; then
  TOKEN=$($PY manage.py principal rotate local --config $CONFIG | tail -n 1)
else
  TOKEN=$($PY manage.py principal create local --actions shared_read,shared_write,shared_manage,chat --config $CONFIG | tail -n 1)
fi
LISTEN=$($PY -c 'import json;print(json.load(open("var/gateway.json"))["listen"])')
cat <<MSG

  AOTX Shared (embedded default)
  API:    http://$LISTEN/aotx/v1/shared/
  Admin:  http://$LISTEN/admin/
  Token for principal "local" (a new one each start):
  export TOKEN=$TOKEN
  curl -H "Authorization: Bearer \$TOKEN" http://$LISTEN/aotx/v1/shared/capabilities

MSG
exec .venv/bin/honcho start -f Procfile
