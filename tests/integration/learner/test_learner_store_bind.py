"""A one-rank learner listens on nothing but loopback: its DeepSpeed engine is started in a plain process (no launcher,
as ``rl-learner train`` and ``rl-launch`` start it), and the kernel's socket tables (/proc/net/tcp, tcp6) are read for
that process's listening sockets. ``env://`` would have put a TCPStore server on every interface (``::``), where any
client could write and read its keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.torchrun import REPO, launcher_env

ENGINE = """
import sys
from asyncrl.common.config import RunConfig
from asyncrl.learner.update.engine import PolicyEngine
config = RunConfig.model_validate({"run": {"name": "bind", "root": sys.argv[2]}, "model": {"path": sys.argv[1]}})
engine = PolicyEngine(config, global_batch=4)
print("ready", flush=True)
sys.stdin.read()  # held open until the test has looked
"""
LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
LOOPBACK_V6 = ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")  # ::1, ::ffff:127.0.0.1


def listening(pid: int) -> list[tuple[str, str]]:
    """``(table, local address)`` of each TCP socket ``pid`` holds in the LISTEN state (hex, as /proc writes it)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                found.append((table, fields[1]))
    return found


def is_loopback(table: str, address: str) -> bool:
    host = address.split(":")[0]
    return host.endswith("7F") if table == "tcp" else host in LOOPBACK_V6


def test_a_one_rank_learner_listens_on_loopback_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    # a launcher's MASTER_ADDR of every interface changes nothing: one rank makes no TCP store at all
    env = launcher_env(DS_ACCELERATOR="cpu", MASTER_ADDR="0.0.0.0", PYTHONPATH=str(REPO))
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(tiny_model_dir), str(tmp_path / "runs")],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        lines = iter(engine.stdout.readline, "")  # DeepSpeed prints on stdout too
        assert any(line.strip() == "ready" for line in lines), f"the engine exited with {engine.wait(60)}"
        sockets = listening(engine.pid)
        assert sockets, "no listening socket seen at all: gloo's own one on loopback is expected"
        assert all(is_loopback(table, address) for table, address in sockets), sockets
        assert LOOPBACK_V4 in {address.split(":")[0] for table, address in sockets if table == "tcp"}
    finally:
        engine.communicate("", timeout=60)  # stdin closed: it exits
    assert engine.returncode == 0
