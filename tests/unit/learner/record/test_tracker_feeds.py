"""The trackers' feeds, with stand-in trackers: a broken, missing or stuck tracker never blocks or fails a step, and
the others go on getting every row. The real packages are tests/integration/learner/record/test_trackers.py's."""

from __future__ import annotations

import threading

import pytest

from asyncrl.common.config import ConfigError, load_config
from asyncrl.learner.record import trackers as trackers_module
from asyncrl.learner.record.trackers import QUEUE_ROWS, Trackers


class Recording:
    def __init__(self, config) -> None:
        self.rows: list[tuple[str, int]] = []
        self.closed = False
        RECORDINGS.append(self)

    def metrics(self, step, values) -> None:
        self.rows.append(("metrics", step))

    def samples(self, step, rows) -> None:
        self.rows.append(("samples", step))

    def close(self) -> None:
        self.closed = True


class Raising(Recording):
    def metrics(self, step, values) -> None:
        raise RuntimeError("disk full")


class Stuck(Recording):
    def metrics(self, step, values) -> None:
        STUCK.set()
        RELEASE.wait()  # until the test lets it go: a learner that waited for it would never get past its step


def missing(config):
    raise ImportError("No module named 'wandb'")


RECORDINGS: list[Recording] = []
RELEASE, STUCK = threading.Event(), threading.Event()


def config(*names: str):
    return load_config(None, [f"monitoring.trackers={list(names)}".replace("'", '"')])


def feed(trackers: Trackers, steps: int) -> None:
    """Hand ``trackers`` the rows of ``steps`` steps, each with a samples table, as the learner does."""
    for step in range(1, steps + 1):
        trackers.metrics(step, {"train/loss": 1.0})
        trackers.samples(step, [{"prompt": "1+1="}])


def test_a_broken_tracker_is_said_once_and_the_other_gets_every_row(caplog) -> None:
    RECORDINGS.clear()
    trackers = Trackers(config("tensorboard", "wandb"), make={"tensorboard": Raising, "wandb": Recording})
    feed(trackers, 5)
    trackers.close(timeout_s=10)
    broken, healthy = RECORDINGS
    assert broken.rows == [] and not broken.closed  # it raised on its first row and was fed no more
    assert healthy.rows == [(kind, step) for step in range(1, 6) for kind in ("metrics", "samples")] and healthy.closed
    assert caplog.text.count("tracker stopped writing; the run goes on without it") == 1 and "disk full" in caplog.text


def test_a_tracker_whose_package_is_missing_says_how_to_install_it(caplog) -> None:
    trackers = Trackers(config("wandb"), make={"wandb": missing})
    feed(trackers, 3)
    trackers.close(timeout_s=10)
    assert "tracker is not installed" in caplog.text and "pip install 'asyncrl[trackers]'" in caplog.text


def test_a_stuck_tracker_never_holds_up_a_step_and_its_dropped_rows_are_counted(caplog) -> None:
    RELEASE.clear()
    STUCK.clear()
    trackers = Trackers(config("tensorboard"), make={"tensorboard": Stuck})
    try:
        trackers.metrics(1, {"train/loss": 1.0})
        assert STUCK.wait(30)
        feed(trackers, QUEUE_ROWS)  # returns while the tracker is stuck on its first row: nothing waited for it
        assert not RELEASE.is_set()
        assert trackers.dropped == 2 * QUEUE_ROWS - QUEUE_ROWS  # the queue holds QUEUE_ROWS of them
    finally:
        RELEASE.set()
        trackers.close(timeout_s=10)
    assert caplog.text.count("a tracker is falling behind") == 1


def test_only_known_trackers_are_accepted() -> None:
    assert load_config(None, []).monitoring.trackers == []
    with pytest.raises(ConfigError, match=r"monitoring\.trackers"):
        config("mlflow")


def test_every_tracker_named_in_the_config_has_a_maker() -> None:
    from typing import get_args

    field = load_config(None, []).monitoring.model_fields["trackers"].annotation
    assert set(get_args(get_args(field)[0])) == set(trackers_module.TRACKERS) == set(trackers_module.EXTRAS)
