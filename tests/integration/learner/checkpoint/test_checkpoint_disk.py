"""Checkpoints on a disk that refuses them, for real: a 1 MiB tmpfs fills up during DeepSpeed's save, and a read-only
bind mount refuses a save and a clean-up. The learner says which disk and what to do in one line, removes its
unfinished folder, and nothing a dead save left behind blocks a later save or resume; ``rl-learner train`` dying of it
leaves one traceback in its log and the whole line for ``rl-launch`` to show. Mounting needs root: skipped elsewhere.
Every mount is undone by the test that made it."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.cli.children import why_it_failed
from asyncrl.common.config import RunConfig
from asyncrl.common.observability import metrics as m
from asyncrl.learner.checkpoint.checkpointer import Checkpointer
from asyncrl.learner.checkpoint.disk import disk_refusal, disk_space
from asyncrl.learner.checkpoint.format import CheckpointError, SavedState, capture_rng, open_checkpoint
from asyncrl.learner.checkpoint.history import find_checkpoint
from asyncrl.learner.update.engine import PolicyEngine
from tests.helpers.engine_ranks import LENGTHS
from tests.helpers.machine import unavailable

pytestmark = pytest.mark.usefixtures("one_rank_world")


@contextlib.contextmanager
def mounted(target: Path, *options: str) -> Iterator[Path]:
    """``mount OPTIONS target`` for the block, unmounted after it however it ends; skips where mounting is refused."""
    if os.geteuid() != 0:
        unavailable("mounting a small or read-only file system needs root")
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        unavailable(f"mount {' '.join(options)} refused here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        busy = subprocess.run(["umount", str(target)], capture_output=True, text=True, timeout=30)
        if busy.returncode != 0:  # a file still open on it: detach it anyway, and say so
            subprocess.run(["umount", "--lazy", str(target)], check=True, timeout=30)
            pytest.fail(f"{target} was still in use after the test (an open file?): {busy.stderr.strip()}")


def run_config(root: Path, model_dir: Path, **checkpoint: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": {"name": "disk", "root": str(root)},
            "model": {"path": str(model_dir)},
            "learner": {"zero_stage": 0, "micro_batch_size": 4},
            "checkpoint": {"export_hf": False, **checkpoint},
        }
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> PolicyEngine:
    """One engine for the module: what it saves does not depend on where (the config given to the Checkpointer)."""
    return PolicyEngine(run_config(Path("unused"), tiny_model_dir), global_batch=len(LENGTHS))


def checkpointer(config: RunConfig, engine: PolicyEngine) -> Checkpointer:
    return Checkpointer(config, engine, tokenizer=AutoTokenizer.from_pretrained(config.model.path))


def state(step: int) -> SavedState:
    return SavedState(step=step, version=step, rng=capture_rng())


def test_a_full_disk_is_named_with_its_free_bytes_and_leaves_no_folder(
    tmp_path: Path, tiny_model_dir: Path, engine: PolicyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as disk:
        config = run_config(disk, tiny_model_dir)
        saver = checkpointer(config, engine)
        with caplog.at_level(logging.ERROR), pytest.raises(CheckpointError) as refused:
            saver.save(state(3))  # the model and its Adam moments are several MiB
        message = str(refused.value)
        assert "\n" not in message
        assert f"mounted at {disk}" in message and "bytes free of 1048576" in message
        assert "the disk is full" in message and "checkpoint.keep" in message
        assert str(saver.root / ".tmp-step-3") in message
        assert not list(saver.root.glob(".tmp-step-*")), "the unfinished folder was left behind"
        assert any("checkpoint not saved" in r.getMessage() and str(disk) in r.getMessage() for r in caplog.records)

        # the disk made larger: the same step saves, and it is a complete checkpoint
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True, timeout=30)
        path = saver.save(state(3))
        assert open_checkpoint(path).state.step == 3
        assert find_checkpoint("latest", saver.root) == path
        # what the disk-filling alert compares: the newest checkpoint's bytes against the disk's free bytes
        written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert m.REGISTRY.get_sample_value("asyncrl_learner_checkpoint_bytes") == pytest.approx(written, rel=0.01)
        free, total = disk_space(saver.root / "not-made-yet")
        assert total == 64 * 2**20 and 0 < free <= total - written


def test_a_save_over_a_dead_save_s_folder_of_the_same_step_works(
    tmp_path: Path, tiny_model_dir: Path, engine: PolicyEngine
) -> None:
    config = run_config(tmp_path / "runs", tiny_model_dir)
    stale = config.run_dir / "checkpoints" / ".tmp-step-5"
    (stale / "policy").mkdir(parents=True)
    (stale / "policy" / "junk").write_text("from a learner killed mid-save")
    saver = checkpointer(config, engine)
    assert not stale.exists()  # removed when the next learner starts
    (stale / "policy").mkdir(parents=True)  # and one that appears later is replaced by a save of its step
    (stale / "policy" / "junk").write_text("again")
    path = saver.save(state(5))
    assert "policy/junk" not in open_checkpoint(path).files and not stale.exists()


def test_a_read_only_disk_neither_blocks_a_resume_nor_hides_a_failed_save(
    tmp_path: Path, tiny_model_dir: Path, engine: PolicyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    config = run_config(tmp_path / "runs", tiny_model_dir)
    saved = checkpointer(config, engine).save(state(2))
    root = saved.parent
    (root / ".tmp-step-4" / "policy").mkdir(parents=True)  # a learner died while saving step 4
    with mounted(root, "-o", "bind,ro", str(root)):
        with caplog.at_level(logging.WARNING):
            saver = checkpointer(config, engine)  # a resume starts: the leftover cannot go, and does not matter
        assert (root / ".tmp-step-4").is_dir()
        assert any("unfinished checkpoint folder" in r.getMessage() for r in caplog.records)
        assert find_checkpoint("latest", root) == saved
        assert saver.load(open_checkpoint(saved)).step == 2

        with pytest.raises(CheckpointError, match=r"read-only.*remount it read-write") as refused:
            saver.save(state(4))
        assert f"mounted at {root}" in str(refused.value) and str(root / ".tmp-step-4") in str(refused.value)
    assert checkpointer(config, engine).save(state(4)).name == "step-4"  # writable again: the leftover goes


def test_torch_s_short_write_error_is_read_as_a_full_disk(tmp_path: Path) -> None:
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1472 vs 1366")
    message = disk_refusal(error, tmp_path / "checkpoints" / ".tmp-step-1")
    assert message is not None and "the disk is full" in message and "unexpected pos 1472" in message
    assert disk_refusal(RuntimeError("shapes do not match"), tmp_path) is None


LEARNER_WITH_A_STEP_TO_SAVE = """
import sys
from asyncrl.cli import learner as cli
from asyncrl.learner import run_state

init = run_state.RunState.__init__


def with_a_step_to_save(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self._rewards = [0.5]  # as if a step were trained (no actor here): the stop saves a checkpoint


run_state.RunState.__init__ = with_a_step_to_save
sys.argv = ["rl-learner", "train", *sys.argv[1:]]
cli.main()
"""


def test_a_learner_that_dies_of_a_full_disk_logs_one_traceback_and_the_launcher_shows_the_whole_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``rl-learner train`` as ``rl-launch`` starts it (its output in a log file): no actor comes within
    ``learner.no_actors_s``, so it saves a checkpoint on a 1 MiB disk, which refuses it. The log holds the learner's
    line, one traceback (not one per chained exception, not in a panel cut at the terminal's width, no ``[rank0]: ``
    before each line) and the cause on one line, last; the launcher's line is that cause, whole."""
    run_dir = tmp_path / "runs" / "disk"
    settings = [f"run.root={tmp_path / 'runs'}", "run.name=disk", f"model.path={tiny_model_dir}"]
    settings += ["learner.zero_stage=0", "checkpoint.export_hf=false", "learner.no_actors_s=1"]
    log = tmp_path / "learner.log"
    with mounted(run_dir / "checkpoints", "-t", "tmpfs", "-o", "size=1m", "tmpfs"), log.open("wb") as out:
        args = [sys.executable, "-c", LEARNER_WITH_A_STEP_TO_SAVE, *(a for s in settings for a in ("--set", s))]
        code = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert text.count("Traceback (most recent call last)") == 1 and "[rank" not in text and "╭" not in text, text
    said, traceback_at = text.index("checkpoint not saved step="), text.index("Traceback (most recent call last)")
    assert said < traceback_at, "the learner's own line comes first, then the traceback"
    last = text.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: CheckpointError: checkpoint not saved: writing ") and last.endswith("(run.root)")

    line = why_it_failed(code, log)
    assert "\n" not in line and "…" not in line
    assert line == f"{last.removeprefix('error: ')} (the whole log: {log})"
    assert f"mounted at {run_dir / 'checkpoints'}" in line and "the disk is full" in line
