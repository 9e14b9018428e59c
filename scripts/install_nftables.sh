#!/usr/bin/env bash
# nftables, for the replication fault harness (bench/nemesis.py, tests/e2e/test_nemesis.py): it cuts
# one machine (a network namespace) from etcd alone while its other links stay up.
exec "$(dirname "$0")/install_apt.sh" nft nftables "the replication fault harness"
