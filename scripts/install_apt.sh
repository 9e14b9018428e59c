#!/usr/bin/env bash
# install_apt.sh COMMAND PACKAGE WHY: Debian's PACKAGE when COMMAND is missing (apt-get, as root or
# through sudo; the package lists are refreshed only when the first try fails); a no-op when present.
set -euo pipefail
command_name=$1 package=$2 why=$3
if command -v "$command_name" >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no $command_name and no apt-get: install $package for $why" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "setup: installing Debian's $package for $why (apt-get)"
$SUDO apt-get install -y -q "$package" || { $SUDO apt-get update -q && $SUDO apt-get install -y -q "$package"; }
