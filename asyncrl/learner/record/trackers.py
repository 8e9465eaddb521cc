"""Experiment trackers (``monitoring.trackers``): each step's metrics row, and the samples of samples.jsonl, mirrored
to TensorBoard and to Weights & Biases (offline by default).

A tracker is fed from a queue by a thread of its own, so a slow or broken tracker never holds up a training step: a
full queue drops the row (counted, and said once), and a tracker that raises is said once, with what to do, and fed
no more. metrics.jsonl stays the record; a tracker is a view of it.

TensorBoard writes event files under ``<run>/tensorboard/`` (``tensorboard --logdir runs/<name>/tensorboard``), the
samples as a text table per step. W&B writes its run under ``<run>/wandb/`` (``wandb sync`` uploads an offline run
later), the samples as a ``wandb.Table``; ``monitoring.wandb_mode = "online"`` sends as it goes, with the credentials
W&B itself reads (``WANDB_API_KEY``). Both packages are optional (``pip install asyncrl[trackers]``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from asyncrl.common.config import RunConfig
from asyncrl.common.observability.logs import get_logger

log = get_logger("trackers")

QUEUE_ROWS = 1000
"""Rows a tracker may fall behind by before new ones are dropped (a step adds one, and samples one more)."""
SAMPLE_FIELDS = ("step", "pick", "prompt", "response", "reward", "advantage", "finish_reason", "staleness")
"""The samples.jsonl fields a tracker's table shows."""


class Tracker(Protocol):
    def metrics(self, step: int, values: dict[str, float]) -> None: ...
    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, config: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(config.run_dir / "tensorboard"))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        header = "| " + " | ".join(SAMPLE_FIELDS) + " |\n|" + "---|" * len(SAMPLE_FIELDS) + "\n"
        body = "".join("| " + " | ".join(_cell(row.get(f)) for f in SAMPLE_FIELDS) + " |\n" for row in rows)
        self.writer.add_text("samples", header + body, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, config: RunConfig) -> None:
        import wandb

        self.wandb = wandb
        folder = config.run_dir
        self.run = wandb.init(
            project=config.monitoring.wandb_project,
            name=config.run.name,
            dir=str(folder),
            mode=config.monitoring.wandb_mode,
            config=config.model_dump(mode="json"),
            resume="allow",
            id=f"{config.run.name}-{_stable_id(folder)}",
        )

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        data: list[Iterable[Any]] = [[row.get(f) for f in SAMPLE_FIELDS] for row in rows]
        table = self.wandb.Table(columns=list(SAMPLE_FIELDS), data=data)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, Callable[[RunConfig], Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Trackers:
    """The run's trackers, each fed by its own thread (rank 0 only). :meth:`metrics` and :meth:`samples` never block
    and never raise."""

    def __init__(self, config: RunConfig, make: dict[str, Callable[[RunConfig], Tracker]] = TRACKERS) -> None:
        self._feeds = [_Feed(name, make[name], config) for name in config.monitoring.trackers]

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for feed in self._feeds:
            feed.put(("metrics", step, dict(values)))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for feed in self._feeds:
            feed.put(("samples", step, list(rows)))

    def close(self, timeout_s: float = 30.0) -> None:
        """Let each tracker write what it was given (up to ``timeout_s`` each), then close it."""
        for feed in self._feeds:
            feed.close(timeout_s)

    @property
    def dropped(self) -> int:
        return sum(feed.dropped for feed in self._feeds)


class _Feed:
    """One tracker behind a bounded queue and a daemon thread; it is made on that thread too (W&B's start takes
    seconds)."""

    def __init__(self, name: str, make: Callable[[RunConfig], Tracker], config: RunConfig) -> None:
        self.name, self.make, self.config = name, make, config
        self.queue: queue.Queue = queue.Queue(QUEUE_ROWS)
        self.dropped = 0
        self.broken = False
        self.thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        if self.broken:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            if self.dropped == 0:
                log.warning(
                    "a tracker is falling behind; rows it cannot take are dropped (metrics.jsonl has them all)",
                    tracker=self.name,
                    queued=QUEUE_ROWS,
                )
            self.dropped += 1

    def close(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for room behind the rows still queued, then for the tracker to write them."""
        if not self.broken:
            with contextlib.suppress(queue.Full):
                self.queue.put(("close", 0, None), timeout=timeout_s)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        tracker = self._start()
        while tracker is not None:
            kind, step, payload = self.queue.get()
            try:
                if kind == "close":
                    tracker.close()
                    return
                getattr(tracker, kind)(step, payload)
            except Exception as exc:  # a broken tracker must not take the run with it
                self._broke("stopped writing", exc)
                return

    def _start(self) -> Tracker | None:
        try:
            return self.make(self.config)
        except ImportError as exc:
            self._broke("is not installed", exc, f"pip install 'asyncrl[trackers]' (or {EXTRAS[self.name]})")
        except Exception as exc:
            self._broke("could not start", exc)
        return None

    def _broke(self, what: str, exc: BaseException, action: str = "") -> None:
        self.broken = True
        log.error(
            f"tracker {what}; the run goes on without it (metrics.jsonl has every row)",
            tracker=self.name,
            error=repr(exc),
            action=action
            or f"check the {self.name} tracker's settings under [monitoring], or remove it from monitoring.trackers",
        )


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _stable_id(folder: Path) -> str:
    """The same W&B run id for every learner of one run folder (a resume continues the same W&B run)."""
    import hashlib

    return hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]
