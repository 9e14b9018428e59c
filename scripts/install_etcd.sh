#!/usr/bin/env bash
# etcd, for replication's leadership lease and its tests (docs/replication.md): Debian's etcd-server.
# Installed with apt when missing; a no-op when present. Nothing runs it as a service here: the
# tests start their own members on loopback, and a deployment runs its own cluster.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no etcd and no apt-get: install etcd 3.4 or later for the replication tests" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "setup: installing Debian's etcd-server for the replication tests (apt-get, ~10 s)"
$SUDO apt-get install -y -q etcd-server || { $SUDO apt-get update -q && $SUDO apt-get install -y -q etcd-server; }
