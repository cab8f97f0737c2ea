"""Two "hosts" on this machine: two network namespaces joined by a veth pair.

    with TwoHosts() as hosts:                      # root only; else HostsUnavailable(reason)
        hosts.shape(12.5e6)                        # tbf on both ends: 100 Mbit/s each way
        agent = hosts.torchrun("a", script, [...]) # torchrun inside host A, c10d across the link
        ...
        hosts.kill("b")                            # every process of host B, SIGKILL
        hosts.link(up=False)                       # cut the link (carrier down on both ends)

Each namespace holds one end of the veth pair with a private address (10.231.X.Y/30) and its own
loopback, brought up; nothing else, so traffic between the hosts crosses the veth pair only and
reaches no address outside the namespaces. `tc` shapes the pair (`tbf`; this kernel has no
`netem`, so the latency is the veth pair's own). Names carry this process's id and a counter, so
parallel runs do not collide. On exit, even after a failure or a timeout, every process in the
namespaces is killed (`ip netns pids`: torchrun's workers run in sessions of their own, so
process groups alone would miss them) and the namespaces are deleted, which deletes the veth
pair with them. Used by tests/test_multihost.py (the `hosts` fixture) and
benchmarks/multihost.py; docs/multihost.md.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
_COMMAND_S = 10.0  # the longest any ip or tc command may take
_counter = itertools.count()


class HostsUnavailable(RuntimeError):
    """The namespaces cannot be made here (not root, no `ip`, or the kernel refuses)."""


@dataclass(frozen=True)
class Host:
    """One end: `label` ("a" or "b"), its namespace, its veth interface and address."""

    label: str
    netns: str
    ifname: str
    address: str


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the multihost tier as root)"
    if not os.path.exists(IP):
        return "no `ip` command (iproute2) on this machine"
    return None


class TwoHosts:
    """Hosts "a" and "b": namespaces joined by a veth pair, and the processes started in them.

    Raises:
        HostsUnavailable: on entry, when the namespaces cannot be made (the reason).
    """

    def __init__(self) -> None:
        n = next(_counter)
        base = f"pd{os.getpid()}n{n}"  # an interface name holds 15 characters
        subnet = f"10.231.{os.getpid() % 256}.{4 * (n % 64)}"
        prefix, last = subnet.rsplit(".", 1)
        self.hosts = {
            label: Host(label, f"{base}{label}", f"{base}{label}", f"{prefix}.{int(last) + i}")
            for i, label in ((1, "a"), (2, "b"))
        }
        self._processes: list[tuple[str, subprocess.Popen, IO]] = []
        self._made: list[str] = []

    def __getitem__(self, label: str) -> Host:
        return self.hosts[label]

    def __enter__(self) -> TwoHosts:
        reason = unavailable()
        if reason:
            raise HostsUnavailable(reason)
        a, b = self.hosts["a"], self.hosts["b"]
        try:
            for host in (a, b):
                _run([IP, "netns", "add", host.netns])
                self._made.append(host.netns)
            _run([IP, "link", "add", a.ifname, "netns", a.netns, "type", "veth",
                  "peer", "name", b.ifname, "netns", b.netns])  # fmt: skip
            for host in (a, b):
                _run([IP, "-n", host.netns, "addr", "add", f"{host.address}/30",
                      "dev", host.ifname])  # fmt: skip
                _run([IP, "-n", host.netns, "link", "set", "dev", host.ifname, "up"])
                _run([IP, "-n", host.netns, "link", "set", "dev", "lo", "up"])
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            self.close()
            raise HostsUnavailable(
                f"cannot make the namespaces: `{' '.join(exc.cmd)}` failed: "
                f"{(exc.stderr or '').strip()}"
            ) from exc
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process of both hosts and delete the namespaces (and so the veth pair)."""
        for label in self.hosts:
            self.kill(label)
        for netns in self._made:
            subprocess.run([IP, "netns", "del", netns], capture_output=True, timeout=_COMMAND_S)
        self._made = []
        for _, _, log in self._processes:
            log.close()

    def shape(self, bytes_per_s: float, burst: int | None = None) -> None:
        """Limit both directions to `bytes_per_s` (tc `tbf` on each end's egress).

        `burst`: bytes sent at line rate before the limit holds (default: 1/250 s of traffic,
        at least 16 KiB: under one timer tick's worth, HZ=250 here, tbf falls short of the
        rate).
        """
        if not os.path.exists(TC):
            raise HostsUnavailable("no `tc` command (iproute2) on this machine")
        burst = burst or max(16 * 1024, int(bytes_per_s / 250))
        for host in self.hosts.values():
            _run([IP, "netns", "exec", host.netns, TC, "qdisc", "replace", "dev", host.ifname,
                  "root", "tbf", "rate", f"{int(bytes_per_s * 8)}bit", "burst", str(burst),
                  "latency", "200ms"])  # fmt: skip

    def link(self, up: bool) -> None:
        """Bring host A's end of the link up or down (the carrier drops on both ends)."""
        a = self.hosts["a"]
        _run([IP, "-n", a.netns, "link", "set", "dev", a.ifname, "up" if up else "down"])

    def tx_bytes(self, label: str) -> int:
        """Bytes host `label` has sent over the link so far."""
        host = self.hosts[label]
        out = _run([IP, "-j", "-s", "-n", host.netns, "link", "show", "dev", host.ifname])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def start(
        self, label: str, argv: Sequence[str], *, env: dict[str, str], log: Path
    ) -> subprocess.Popen:
        """Start `argv` inside host `label`'s namespace, in a session of its own, its output in
        `log`; it is killed on `kill(label)` and on exit."""
        host = self.hosts[label]
        out = open(log, "ab")  # noqa: SIM115 - closed by close()
        process = subprocess.Popen(
            [IP, "netns", "exec", host.netns, *argv], env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._processes.append((label, process, out))
        return process

    def torchrun(
        self,
        label: str,
        script: str,
        args: Sequence[str],
        *,
        log: Path,
        nproc: int = 2,
        port: int = 29400,
        run_id: str = "pdcompile",
        max_restarts: int = 0,
        join_timeout_s: int = 60,
    ) -> subprocess.Popen:
        """`torchrun --nnodes 2 --nproc-per-node nproc` on host `label`, meeting the other host
        through c10d rendezvous at host A's address (host A's agent holds the store). Host A's
        ranks come first (torchrun orders nodes by address). gloo and TensorPipe are pinned to
        the veth interface; every worker runs at one thread and knows its host as
        `PDCOMPILE_TEST_HOST`."""
        host, a = self.hosts[label], self.hosts["a"]
        conf = {
            "is_host": str(label == "a").lower(), "join_timeout": join_timeout_s,
            "close_timeout": 5, "read_timeout": join_timeout_s, "keep_alive_interval": 1,
            "keep_alive_max_attempt": 3,
        }  # fmt: skip
        launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        argv = [
            launcher, "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.address}:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
            "--local-addr", host.address, "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", script, *args,
        ]  # fmt: skip
        variables = {
            **os.environ, "GLOO_SOCKET_IFNAME": host.ifname, "TP_SOCKET_IFNAME": host.ifname,
            "OMP_NUM_THREADS": "1", "PDCOMPILE_TEST_HOST": label, "PYTHONUNBUFFERED": "1",
            # torch 2.13's agents share their rendezvous store with the workers by default, and
            # a host that rejoins after its agent died then waits forever for the store's
            # address (pytorch/pytorch#135712): every round publishes its own instead
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }  # fmt: skip
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            variables.pop(name, None)
        return self.start(label, argv, env=variables, log=log)

    def pids(self, label: str) -> list[int]:
        """The processes inside host `label`'s namespace."""
        netns = self.hosts[label].netns
        if netns not in self._made:
            return []
        out = subprocess.run([IP, "netns", "pids", netns], capture_output=True, text=True,
                             timeout=_COMMAND_S).stdout  # fmt: skip
        return [int(p) for p in out.split()]

    def kill(self, label: str, within_s: float = 10.0) -> None:
        """SIGKILL every process of host `label` (agents and workers) and reap them."""
        deadline = time.monotonic() + within_s
        while True:
            for pid in self.pids(label):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _, process, _ in [p for p in self._processes if p[0] == label]:
                if process.poll() is None:
                    try:
                        process.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
            if not self.pids(label) or time.monotonic() > deadline:
                return
            time.sleep(0.1)


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          timeout=_COMMAND_S).stdout  # fmt: skip
