"""vLLM's IPC sockets go to a folder of the actor's own: made with mode 0700, pointed at by ``VLLM_RPC_BASE_PATH``,
removed on release; folders of processes that are gone are removed by the next claim, live ones and links kept."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.actors import ipc_folder


def use_temp(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(ipc_folder.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    return folder


@pytest.fixture
def temp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short temp folder (pytest's own are too long for socket paths in a folder below them)."""
    folder = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    try:
        yield use_temp(folder, monkeypatch)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_temp_folder_too_long_for_socket_paths_leaves_vllm_its_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = use_temp(tmp_path / ("d" * 60), monkeypatch)
    deep.mkdir()
    assert ipc_folder.claim() is None
    assert "VLLM_RPC_BASE_PATH" not in os.environ and list(deep.iterdir()) == []
    ipc_folder.release(None)


def gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def bound_socket(folder: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(folder / "0b5e-uuid"))  # left behind, as vLLM leaves its own


def test_claim_points_vllm_at_a_private_folder_and_release_removes_it_with_its_sockets(temp: Path) -> None:
    folder = ipc_folder.claim()
    assert folder == temp / f"asyncrl-vllm-{os.getpid()}"
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    bound_socket(folder)
    assert ipc_folder.claim() == folder  # a second engine of the process: the same path (vLLM caches it)
    ipc_folder.release(folder)
    assert list(temp.iterdir()) == []
def test_folders_of_gone_processes_are_removed_and_live_ones_kept(temp: Path) -> None:
    gone = temp / f"asyncrl-vllm-{gone_pid()}"
    gone_suffixed = temp / f"asyncrl-vllm-{gone_pid()}-x1y2"
    live = temp / f"asyncrl-vllm-{os.getppid()}"
    unrelated = temp / "asyncrl-vllm-notapid"
    for folder in (gone, gone_suffixed, live, unrelated):
        folder.mkdir()
    bound_socket(gone)
    assert sorted(ipc_folder.remove_stale(temp)) == sorted([gone, gone_suffixed])
    assert sorted(p.name for p in temp.iterdir()) == sorted([live.name, unrelated.name])
def test_a_link_in_the_folders_place_is_neither_used_nor_followed(temp: Path) -> None:
    elsewhere = temp / "elsewhere"
    elsewhere.mkdir()
    (temp / f"asyncrl-vllm-{os.getpid()}").symlink_to(elsewhere)
    folder = ipc_folder.claim()
    assert folder.parent == temp and folder.name.startswith(f"asyncrl-vllm-{os.getpid()}-") and not folder.is_symlink()
    gone_link = temp / f"asyncrl-vllm-{gone_pid()}"
    gone_link.symlink_to(elsewhere)
    ipc_folder.remove_stale(temp)
    assert gone_link.is_symlink() and elsewhere.is_dir()  # not ours to remove, and never followed
    ipc_folder.release(folder)
