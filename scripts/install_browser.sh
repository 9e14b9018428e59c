#!/usr/bin/env bash
# The browser the tests drive with Playwright: Debian's chromium (Playwright's own browser download
# does not work on these machines). Installed with apt when missing; a no-op when present.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no chromium and no apt-get: install Chromium for the browser tests" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "setup: installing Debian's chromium for the browser tests (apt-get, ~20 s)"
$SUDO apt-get install -y -q chromium || { $SUDO apt-get update -q && $SUDO apt-get install -y -q chromium; }
