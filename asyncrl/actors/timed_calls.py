"""Reward calls with a time limit: each on a daemon thread of its own, abandoned when it overruns.

The reward worker scores through :class:`TimedCalls`; a call past ``reward.timeout_s`` raises :class:`CallTimedOut`
(and is retried), and a worker with too many abandoned calls still running raises :class:`WorkerStalled` (only a new
process frees those threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from asyncrl.common.rewards.functions import RewardError

MAX_ABANDONED_CALLS = 8
"""Abandoned (timed-out, still running) reward calls a worker tolerates before it stalls."""


class CallTimedOut(TimeoutError):
    """A reward call ran past its time limit and was abandoned."""


class WorkerStalled(RewardError):
    """Too many abandoned calls are still running: only a restart of the process frees their threads."""


class TimedCalls:
    """Runs calls with a time limit, each on a daemon thread of its own, and abandons those that overrun.

    A Python thread cannot be killed: a call past its limit is abandoned — its thread runs on and its
    result is ignored. Reward functions whose work can hang should do it in a killable subprocess, as
    ``code_tests`` does (every sandbox run has its own wall-clock limit), so their abandoned threads end
    soon after. At most ``max_abandoned`` abandoned calls may still be running; beyond that :meth:`run`
    raises :class:`WorkerStalled` instead of starting more threads.

    Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit, so one
    hung call would hang the worker's shutdown; and once its threads were all hung, new calls would wait
    in its queue, and their time limit would measure the queue rather than the call.
    """

    def __init__(self, max_abandoned: int = MAX_ABANDONED_CALLS) -> None:
        self.max_abandoned = max_abandoned
        self._abandoned: set[Future[Any]] = set()

    def abandoned(self) -> int:
        """Abandoned calls whose threads are still running."""
        self._abandoned = {f for f in self._abandoned if not f.done()}
        return len(self._abandoned)

    def run(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        """``fn(*args)``, or :class:`CallTimedOut` after ``timeout_s``; ``fn``'s own exceptions propagate."""
        if self.abandoned() >= self.max_abandoned:
            raise WorkerStalled(name, f"{self.max_abandoned} abandoned calls are still running; restart the worker")
        future: Future[Any] = Future()
        threading.Thread(target=_fill, args=(future, fn, args), name=f"reward:{name}", daemon=True).start()
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            if not future.done():
                self._abandoned.add(future)
                raise CallTimedOut(f"timed out after {timeout_s} s") from None
            return future.result()  # it finished at the limit, or raised a TimeoutError of its own


def _fill(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # handed to the waiting caller, never lost in this thread
        future.set_exception(exc)
    else:
        future.set_result(result)
