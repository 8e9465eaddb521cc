"""Hosts on one machine for the tests that need several: one Linux network namespace per address, on a bridge in a
namespace of its own, so no address or link of a test appears in the machine's own network.

A host may also have a name: ``ip netns exec`` binds the files of ``/etc/netns/<namespace>/`` over ``/etc/``, so each
host's ``/etc/hosts`` lists every host by name, and :meth:`Hosts.exec_named` starts a process in a UTS namespace of its
own whose hostname is the host's (a scheduler such as Slurm finds its node by ``gethostname``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
CLONE_NEWNET = 0x40000000


class Hosts:
    """One network namespace per address, each with ``lo`` and an ``eth0`` on a bridge that lives in a namespace of
    its own: no address or link of the test appears in the machine's namespace. :meth:`delete` removes them all."""

    def __init__(self, prefix: str, addresses: list[str], hostnames: dict[str, str] | None = None) -> None:
        self.prefix = prefix
        self.names = {address: f"{prefix}-{n}" for n, address in enumerate(addresses)}
        self.hostnames = hostnames or {}  # address -> hostname, for the hosts that have one
        self.switch = f"{prefix}-sw"
        self.made: list[str] = []

    def create(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "dev", "br0", "up")
        for n, (address, ns) in enumerate(self.names.items()):
            self._netns(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{n}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "dev", f"p{n}", "master", "br0")
            _ip("-n", self.switch, "link", "set", "dev", f"p{n}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "dev", "eth0", "up")
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
        if self.hostnames:
            self._write_etc_hosts()

    def _write_etc_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{a} {name}" for a, name in self.hostnames.items())]
        for ns in self.names.values():
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def delete(self) -> None:
        for name in reversed(self.made):  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self.made.clear()

    def exec(self, address: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[address]]

    def exec_named(self, address: str) -> list[str]:
        """A command's prefix to run it on the host as a machine of its own: in its network namespace, with the
        host's hostname (a UTS namespace) and ``/etc/hosts`` (a mount namespace, private). Unlike :meth:`exec`, the
        machine's ``/sys`` stays as it is (``ip netns exec`` mounts a new one, which has no cgroup hierarchies)."""
        named = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            "nsenter", f"--net=/run/netns/{self.names[address]}", "unshare", "--uts", "--mount", "--", "sh", "-c",
            named, self.hostnames[address], str(NETNS_ETC / self.names[address] / "hosts"),
        ]  # fmt: skip

    def thread_in(self, address: str) -> ThreadPoolExecutor:
        """One thread in ``address``'s namespace (``setns`` moves only the calling thread): sockets it opens are that
        host's. The test's Redis reads and scrapes run there."""
        libc = ctypes.CDLL(None, use_errno=True)
        path = f"/run/netns/{self.names[address]}"

        def enter() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {path} failed")
            finally:
                os.close(fd)

        return ThreadPoolExecutor(1, initializer=enter, thread_name_prefix="netns")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")
