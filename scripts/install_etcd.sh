#!/usr/bin/env bash
# etcd, for replication's leadership lease and its tests (docs/replication.md): Debian's etcd-server.
# Nothing runs it as a service here: the tests start their own members on loopback, and a
# deployment runs its own cluster.
exec "$(dirname "$0")/install_apt.sh" etcd etcd-server "the replication tests"
