#!/usr/bin/env bash
# The browser the tests drive with Playwright: Debian's chromium (Playwright's own browser download
# does not work on these machines).
exec "$(dirname "$0")/install_apt.sh" chromium chromium "the browser tests"
