"""A real etcd cluster for the tests: `members` etcd processes (Debian's etcd-server, installed by
`make setup`: scripts/install_etcd.sh) on loopback ports, each with its data in `directory`."""
import json
import os
import shutil
import signal
import subprocess
import urllib.request

from tests.conftest import free_port, wait_for


class EtcdCluster:
    def __init__(self, directory, members=3):
        binary = shutil.which("etcd")
        assert binary, "etcd is not installed: run `make setup` (scripts/install_etcd.sh)"
        self.binary, self.directory = binary, str(directory)
        self.names = [f"m{i}" for i in range(members)]
        self.client = {n: free_port() for n in self.names}
        self.peer = {n: free_port() for n in self.names}
        self.procs = {}

    @property
    def endpoints(self):
        return [f"http://127.0.0.1:{self.client[n]}" for n in self.names]

    def start(self):
        cluster = ",".join(f"{n}=http://127.0.0.1:{self.peer[n]}" for n in self.names)
        for n in self.names:
            log = open(os.path.join(self.directory, f"{n}.log"), "ab")
            self.procs[n] = subprocess.Popen(
                [self.binary, "--name", n, "--data-dir", os.path.join(self.directory, n),
                 "--listen-client-urls", f"http://127.0.0.1:{self.client[n]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.client[n]}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer[n]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[n]}",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
        wait_for(self.healthy, 60, what="the etcd cluster to elect a leader")
        return self

    def healthy(self):
        try:
            with urllib.request.urlopen(self.endpoints[0] + "/health", timeout=1) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(30)
        self.procs = {}

    def pause(self):
        """Every member stopped (SIGSTOP): etcd unreachable, nothing lost."""
        for proc in self.procs.values():
            proc.send_signal(signal.SIGSTOP)

    def resume(self):
        for proc in self.procs.values():
            proc.send_signal(signal.SIGCONT)
