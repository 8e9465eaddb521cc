"""The learner: admit prompts, take whole scored groups from the replay stream, train, broadcast.

One step is a table of contents of five owners (:meth:`Learner.step`)::

    take a batch for this version   BatchSource     admission, replay, duplicates / forgeries / stale dropped
    train on it                     PolicyUpdate    π_old, advantages, the optimizer step (and the critic's)
    settle the batch                BatchSource     which step trained which group; acknowledgements
    publish the new weights         Broadcaster     bump the version, send it (overlapped with the next step)
    record the step                 Recorder        metrics.jsonl, telemetry, health facts
    roll back if that is due        RunState        (through health) a resume from an older checkpoint

and every ``checkpoint.every`` steps, at the end and on SIGTERM, :meth:`RunState.save` writes a checkpoint.
With ``[eval]``, the batch source issues and records eval rounds on the way (``learner/intake/evaluation.py``) and, at
the end, waits for the last one.

Staleness (:class:`asyncrl.common.staleness.StalenessBound`): a group whose oldest token is older than
``v − max_staleness`` is dropped and counted; admission control makes that rare. Replay entries are acknowledged
only after the step that used them has been applied — with periodic checkpoints, only once a checkpoint holds
that step (:mod:`asyncrl.learner.intake.trained`) — so a learner crash re-reads them, and a resume trains them again.

Resume (``--resume``): the checkpoint's weights, optimizer, KL coefficient and RNGs come back, the groups
trained after it are trained again, metrics.jsonl is cut back to its step (later lines move to
``metrics.discarded.jsonl``) and continues from step N + 1, and the restored weights are sent to the actors
under a bumped restore generation, so that actors holding weights of the discarded steps load them too.
A group sampled by such weights stays a valid off-policy sample: its behaviour log-probs μ travel with
it and π_old/μ corrects it like any stale one; ``rollout/tokens_ahead`` counts its tokens stamped with a
version above the one that trains them.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from asyncrl.common.config import RunConfig, write_resolved
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import set_alert
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.learner import ranks
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.checkpoint.format import Checkpoint
from asyncrl.learner.health.monitor import HealthMonitor
from asyncrl.learner.intake.batch_source import BatchSource, NoActorsLeft, StepInterrupted
from asyncrl.learner.record.profile import profiled
from asyncrl.learner.record.recorder import Recorder, StepRecord
from asyncrl.learner.run_state import RunState
from asyncrl.learner.update.policy import PolicyUpdate
from asyncrl.learner.weights.broadcaster import Broadcaster

log = get_logger("learner")


class Learner:
    """Wires the five owners of one run's learner and drives them step by step (see the module docstring)."""

    def __init__(
        self, config: RunConfig, redis_url: str, resume: Checkpoint | None = None, profile_step: int | None = None
    ) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.profile_step = profile_step  # this step runs under cProfile (learner/record/profile.py)
        algorithm = assemble(config)  # a bad option fails here, before DeepSpeed starts
        self.plane = ControlPlane(connect(redis_url, config.transport.redis_outage_s), config.run.name)
        write_resolved(config)
        self.plane.run.publish_config(config)
        self.recorder = Recorder(config, self.plane)  # /metrics is up while DeepSpeed starts
        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.recorder.samples.decode = tokenizer.decode  # an episode's turns in samples.jsonl
        self.broadcaster = Broadcaster(config, self.plane, self.recorder.audit)
        version = self.plane.run.version()
        # The newest version an actor can hold: after a resume, actors may still hold the discarded steps' versions.
        # A bad data file (common.data.task_files.TaskFileError) fails here, before DeepSpeed starts.
        self.batches = BatchSource(config, self.plane, tokenizer, max(version, self.broadcaster.newest_version))
        self.update = PolicyUpdate(config, algorithm, tokenizer.pad_token_id or 0)
        self.state = RunState(
            config,
            version,
            self.update,
            self.batches,
            self.broadcaster,
            self.recorder.metrics_path,
            tokenizer,
            audit=self.recorder.audit,
        )
        self.health = HealthMonitor.for_run(config, checkpoints=self.state, set_alert=set_alert)
        self.recorder.health = self.health
        self._stop = threading.Event()  # set by SIGTERM or the time budget: finish the step, save a checkpoint, exit
        self._stop_reason = "sigterm"  # the checkpoint's reason when _stop is set ("max_minutes": the budget)
        if resume is not None:
            self.state.restore(resume)
        self.recorder.started(resume)  # run.started / run.resumed in the audit trail

    @property
    def version(self) -> int:
        """The policy version: optimizer steps applied (the step being trained is ``version + 1``)."""
        return self.state.version

    # ------------------------------------------------------------------ the run

    def run(self) -> str:
        """Train until step ``learner.steps`` (or SIGTERM), saving checkpoints on the way and at the end. Returns why
        it ended: ``end`` (the run is finished), ``sigterm`` or ``max_minutes``."""
        self.plane.run.set_version(self.version)
        self.plane.run.set_sending(self.version)  # nothing on its way yet (a resume re-sends its version)
        self.state.resume()
        log.info("learner started", run=self.config.run.name, steps=self.config.learner.steps, version=self.version)
        previous = self._stop_on_sigterm()
        budget = self._stop_at_budget()
        outcome = "failed"
        no_actors: NoActorsLeft | None = None
        try:
            every = self.config.checkpoint.every
            while self.version < self.config.learner.steps and not self._stop.is_set():
                try:
                    if self.version + 1 == self.profile_step:
                        profiled(self.version + 1, self.config.run_dir, self.step)
                    else:
                        self.step()
                except NoActorsLeft as exc:
                    self._stop_reason, no_actors = "no_actors", exc  # saved like a stop, then raised for the exit code
                    self._stop.set()
                    break
                except StepInterrupted:
                    break
                if every and self.version % every == 0:
                    self.save_checkpoint("every")
            self.broadcaster.finish()
            self.save_checkpoint(self._stop_reason if self._stop.is_set() else "end")
            self.batches.finish_eval(self.version, self._stop)  # the last policy's eval round (intake/evaluation.py)
            # A stop asked for during the last step still finished the run: its end is the step count, not the flag.
            outcome = "completed" if self.version >= self.config.learner.steps else "stopped"
            if outcome == "completed":
                self.plane.run.mark_finished(self.version)  # the run's actors and reward workers exit now
                self.recorder.telemetry.finished()
        finally:
            if budget is not None:
                budget.cancel()
            ranks.release()  # the other learner ranks (learner/ranks.py) return
            self.broadcaster.close()
            self.health.close()
            self.recorder.close(self.version, outcome)  # run.finished; the learner leaves; audit.jsonl complete
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._say_how_it_ended(outcome)
        if no_actors is not None:
            raise no_actors
        return "end" if outcome == "completed" else self._stop_reason

    def _say_how_it_ended(self, outcome: str) -> None:
        name, steps = self.config.run.name, self.config.learner.steps
        if outcome == "completed":
            log.info("learner finished", run=name, step=self.version, steps=steps)
            return
        log.info(
            "learner stopped before the run finished",
            run=name,
            step=self.version,
            steps=steps,
            reason=self._stop_reason if outcome == "stopped" else outcome,
            action="go on from its last checkpoint with --resume latest",
        )

    def _stop_at_budget(self) -> threading.Timer | None:
        """With ``learner.max_minutes``: a timer that stops the run like SIGTERM does when the budget is spent."""
        minutes = self.config.learner.max_minutes
        if minutes is None:
            return None

        def time_is_up() -> None:
            log.info(
                "learner.max_minutes reached: stopping after the step in progress, then saving a checkpoint",
                minutes=minutes,
                step=self.version + 1,
            )
            self._stop_reason = "max_minutes"
            self._stop.set()

        timer = threading.Timer(minutes * 60, time_is_up)
        timer.daemon = True
        timer.start()
        return timer

    def _stop_on_sigterm(self) -> Callable[[int, FrameType | None], Any] | int | None:
        """SIGTERM sets :attr:`_stop`: the step in progress finishes (a wait for a batch ends at once), a checkpoint
        is saved and :meth:`run` returns. Returns the handler it replaced (None off the main thread: no handler)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, frame: object) -> None:
            log.info(
                "SIGTERM: stopping after the step in progress (a wait for a batch ends now), then saving a checkpoint",
                step=self.version + 1,
            )
            self._stop.set()

        return signal.signal(signal.SIGTERM, handler)

    def step(self) -> StepRecord:
        """One step, as its table of contents."""
        started = time.perf_counter()
        taken = self.batches.take(self.version, self._stop, self._while_waiting)
        batch = self.update.collate(taken.groups)
        trained = self.update.train(batch)
        self.batches.settle(self.version + 1, taken)
        version = self.state.advance(float(taken.rewards().mean()))
        synced = self.broadcaster.publish(version, self.update.params)
        record = self.recorder.record(
            version,
            started,
            taken,
            batch,
            self.update.last_advantages,
            train=trained,
            sync=synced,
            restore=self.state.take_resumed(),
        )
        self.health.roll_back_if_due()  # after the row: a rollback cuts metrics.jsonl back to its checkpoint
        return record

    def _while_waiting(self) -> None:
        """While the learner waits for a batch: an actor that just joined gets the current weights, and a process
        that died is in the audit trail now, not at the next step (which, with the last actor gone, never comes)."""
        self.broadcaster.welcome(self.version, self.update.params)
        self.recorder.note_lost_processes()

    def save_checkpoint(self, reason: str):
        """``step-<N>`` of the current version (None when there is nothing new, or non-finite steps are pending)."""
        return self.state.save(reason, healthy=self.health.healthy)
