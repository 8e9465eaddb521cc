"""Stale build locks in torch's JIT extension cache (learner/jit_lock.py), planted in a temporary
``TORCH_EXTENSIONS_DIR``: a lock nobody builds under is removed with a warning naming it, one whose build is alive is
waited for and then named in one line, one released meanwhile is left alone."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from asyncrl.learner import jit_lock
from asyncrl.learner.jit_lock import StaleLockError, clear_stale_locks, extensions_root, processes_in


@pytest.fixture
def extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "torch_extensions"


def plant(root: Path, op: str = "deepspeed_shm_comm", age_s: float = 3600.0) -> Path:
    """A lock as torch's FileBaton leaves it (an empty file) in ``op``'s build folder, ``age_s`` old."""
    (root / op).mkdir(parents=True, exist_ok=True)
    lock = root / op / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def nobody(folder: Path) -> list[int]:
    return []


def test_the_extensions_dir_is_torch_extensions_dir_when_set(extensions: Path) -> None:
    assert extensions_root() == extensions


def test_a_lock_nobody_builds_under_is_removed_with_a_warning_naming_it(
    extensions: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = plant(extensions)
    (extensions / "cpu_adam").mkdir()  # a finished build: no lock, nothing to do
    with caplog.at_level(logging.WARNING):
        assert clear_stale_locks(builders=nobody) == [lock]  # the default root: $TORCH_EXTENSIONS_DIR
    assert not lock.exists() and (lock.parent).is_dir()  # the build folder stays: ninja finishes what is left
    warned = [r.getMessage() for r in caplog.records if "stale torch extension build lock" in r.getMessage()]
    assert len(warned) == 1 and str(lock) in warned[0]


def test_a_young_lock_gets_the_grace_time_of_a_build_that_is_starting(extensions: Path) -> None:
    lock = plant(extensions, age_s=0.0)
    started = time.monotonic()
    assert clear_stale_locks(extensions, grace_s=0.4, poll_s=0.05, builders=nobody) == [lock]
    assert time.monotonic() - started >= 0.3


def test_a_lock_its_builder_releases_is_left_to_it(extensions: Path) -> None:
    lock = plant(extensions, age_s=0.0)
    threading.Timer(0.2, lock.unlink).start()  # the build finishes and torch deletes its baton
    assert clear_stale_locks(extensions, grace_s=30.0, poll_s=0.05, builders=nobody) == []


def test_a_live_build_is_waited_for_then_named_with_its_process(extensions: Path) -> None:
    lock = plant(extensions)
    with pytest.raises(StaleLockError) as held:
        clear_stale_locks(extensions, wait_s=0.3, poll_s=0.05, builders=lambda folder: [4242])
    message = str(held.value)
    assert "\n" not in message and str(lock) in message and "4242" in message and f"rm {lock}" in message
    assert lock.exists()


def test_a_build_orphaned_by_a_killed_learner_is_waited_out_then_its_lock_removed(extensions: Path) -> None:
    lock = plant(extensions)
    calls = iter([[777], [777], [777]])  # ninja finishes its last compile, then nobody is left
    removed = clear_stale_locks(extensions, grace_s=0.2, poll_s=0.05, builders=lambda folder: next(calls, []))
    assert removed == [lock] and not lock.exists()


def test_a_stale_lock_that_cannot_be_deleted_is_named_with_the_fix(
    extensions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = plant(extensions)

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(StaleLockError, match=r"cannot delete \(Permission denied\).*TORCH_EXTENSIONS_DIR") as refused:
        clear_stale_locks(extensions, builders=nobody)
    assert str(refused.value).startswith(f"{lock}: ")


def test_a_process_working_in_the_build_folder_is_its_builder(
    extensions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = plant(extensions).parent
    assert processes_in(folder) == []
    monkeypatch.chdir(folder / "..")
    assert os.getpid() not in processes_in(folder, exclude=())
    monkeypatch.chdir(folder)  # as ninja and the compiler run: in the op's folder
    assert os.getpid() in processes_in(folder, exclude=())
    assert os.getpid() not in processes_in(folder)  # this process never counts as a builder by default
    assert jit_lock.LOCK_NAME == "lock"


def test_the_environments_ninja_goes_first_on_path_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ninja versions read each other's build log as changed commands; the environment's one always builds."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").write_text("#!/bin/sh\n")
    (bin_dir / "ninja").chmod(0o755)
    monkeypatch.setattr(jit_lock.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert jit_lock.prefer_environment_ninja() == bin_dir / "ninja"
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"
    jit_lock.prefer_environment_ninja()
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"  # not prepended twice


def test_without_a_ninja_of_its_own_path_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit_lock.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert jit_lock.prefer_environment_ninja() is None
    assert os.environ["PATH"] == "/usr/bin:/bin"
