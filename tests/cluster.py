"""Machines on one box, for the replication fault harness (bench/nemesis.py, tests/e2e/test_nemesis.py):
each "machine" is a Linux network namespace with its own address, joined to the others by a veth
pair through a bridge in the root namespace (which holds the harness, its clients and its checker,
at the bridge's address). Each machine runs an etcd member, a device and a gateway of its own; the
journals and runtime files are directories of the one filesystem, but nothing crosses between
machines except over the network (a device's Unix socket is reached by its own machine's gateway
only, and the harness's probes).

The faults the network takes (root only: `ip netns`, veth, a bridge, nftables):

- `partition(m)`: m's link down, both ways (its veth's end on the bridge): m reaches nothing and
  nothing reaches m;
- `cut_etcd(m)`: m's etcd traffic dropped (nftables in m's namespace: client and peer ports, both
  ways), everything else untouched: its device loses its lease while gateways and clients still
  reach it, and its etcd member is cut from the others;
- `heal(m)`: both undone.

Names are short (interface names have 15 characters) and made with a random tag, so runs beside each
other do not meet; `close` removes everything it made.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

ETCD_CLIENT, ETCD_PEER = 2379, 2380


def usable() -> str | None:
    """Why this machine cannot host the cluster (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "etcd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs etcd and nftables)"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class Network:
    def __init__(self, count: int = 3) -> None:
        self.tag = secrets.token_hex(2)
        octets = secrets.randbelow(200) + 20, secrets.randbelow(250) + 1
        self.prefix = f"10.{octets[0]}.{octets[1]}"
        self.host = f"{self.prefix}.254"  # the root namespace's address on the bridge (the harness)
        self.bridge = f"aotx{self.tag}b"
        self.names = [f"m{i}" for i in range(1, count + 1)]
        self.netns = {m: f"aotx{self.tag}{m}" for m in self.names}
        self.veth = {m: f"aotx{self.tag}{m}" for m in self.names}  # the end on the bridge (root namespace)
        self.address = {m: f"{self.prefix}.{i}" for i, m in enumerate(self.names, start=1)}
        self.made: list[tuple[str, ...]] = []  # what close() removes, newest first
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self.made.append(("ip", "link", "del", self.bridge))
            _run("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for m in self.names:
                ns, veth = self.netns[m], self.veth[m]
                _run("ip", "netns", "add", ns)
                self.made.append(("ip", "netns", "del", ns))
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.made.append(("ip", "link", "del", veth))
                _run("ip", "link", "set", veth, "master", self.bridge)
                _run("ip", "link", "set", veth, "up")
                for argv in (("ip", "addr", "add", f"{self.address[m]}/24", "dev", "eth0"),
                             ("ip", "link", "set", "eth0", "up"), ("ip", "link", "set", "lo", "up")):
                    _run("ip", "netns", "exec", ns, *argv)
        except BaseException:
            self.close()
            raise

    def exec(self, m: str) -> list[str]:
        """The argv prefix that runs a command on machine m."""
        return ["ip", "netns", "exec", self.netns[m]]

    def partition(self, m: str) -> None:
        _run("ip", "link", "set", self.veth[m], "down")

    def cut_etcd(self, m: str) -> None:
        ports = f"{{ {ETCD_CLIENT}, {ETCD_PEER} }}"
        rules = "\n".join(["table inet aotx {",
                           "  chain in {", "    type filter hook input priority 0;",
                           f"    tcp dport {ports} drop", f"    tcp sport {ports} drop", "  }",
                           "  chain out {", "    type filter hook output priority 0;",
                           f"    tcp dport {ports} drop", f"    tcp sport {ports} drop", "  }", "}", ""])
        subprocess.run([*self.exec(m), "nft", "-f", "-"], input=rules.encode(), check=True, capture_output=True,
                       timeout=30)

    def heal(self, m: str) -> None:
        _run("ip", "link", "set", self.veth[m], "up")
        subprocess.run([*self.exec(m), "nft", "delete", "table", "inet", "aotx"], capture_output=True, timeout=30)

    def close(self) -> None:
        for argv in reversed(self.made):
            subprocess.run(argv, capture_output=True, timeout=30)
        self.made = []


class Etcd:
    """A three-member etcd cluster, a member on each machine (its data under `directory`)."""

    def __init__(self, network: Network, directory: Path) -> None:
        self.network, self.directory = network, directory
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def endpoints(self) -> list[str]:
        return [f"http://{self.network.address[m]}:{ETCD_CLIENT}" for m in self.network.names]

    def start(self, m: str | None = None, new: bool = True) -> None:
        """Every member (or m's again, from its data: `new` False)."""
        net = self.network
        cluster = ",".join(f"{n}=http://{net.address[n]}:{ETCD_PEER}" for n in net.names)
        for n in ([m] if m else net.names):
            ip = net.address[n]
            with open(self.directory / f"etcd-{n}.log", "ab") as log:
                self.procs[n] = subprocess.Popen(
                    [*net.exec(n), shutil.which("etcd") or "etcd", "--name", n,
                     "--data-dir", str(self.directory / f"etcd-{n}"),
                     "--listen-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                     "--advertise-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                     "--listen-peer-urls", f"http://{ip}:{ETCD_PEER}",
                     "--initial-advertise-peer-urls", f"http://{ip}:{ETCD_PEER}",
                     "--initial-cluster", cluster, "--initial-cluster-state", "new" if new else "existing",
                     "--heartbeat-interval", "50", "--election-timeout", "500"],
                    stdout=log, stderr=subprocess.STDOUT)

    def kill(self, m: str) -> None:
        proc = self.procs.pop(m)
        proc.kill()
        proc.wait(30)

    def stop(self) -> None:
        for n in list(self.procs):
            self.kill(n)
