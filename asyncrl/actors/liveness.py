"""An actor's liveness, for a check that a thread serving ``/metrics`` cannot fool: a file the actor touches every
:data:`TOUCH_S` seconds from its event loop, and only while its engine makes progress (``$ASYNCRL_ALIVE_FILE``;
Kubernetes' liveness probe runs ``cli/deploy.py: ALIVE_CHECK`` on it).

The engine makes progress when it has no group to generate, when the actor is loading weights (a broadcast has its
own time limit, ``weight_sync.timeout_s``), or when it sent a token within the stall limit (:func:`stall_limit_s`)
of the later of its last token and the last moment it was idle or loading weights — so that work taken after a
long idle spell is not judged by the token before it. A hung engine (a request that never returns a token) or a
hung event loop stops the touches, the file ages, the check fails and the kubelet restarts the actor; its groups go
back to the queue when the learner finds its heartbeat gone.
"""

from __future__ import annotations

import os
from pathlib import Path

ALIVE_ENV = "ASYNCRL_ALIVE_FILE"
"""A file the actor touches while its engine makes progress: a liveness check's input (``cli/deploy.py``'s
Kubernetes probe reads its age)."""
TOUCH_S = 10.0
"""How often the file is touched while the engine makes progress."""
STALL_S = 300.0
"""An engine with groups to generate and no token for this long is hung. A group's tokens come every few
milliseconds to seconds; a long prefill on a slow CPU takes tens of seconds."""


def stall_limit_s(step_timeout_s: float) -> float:
    """:data:`STALL_S`, or longer where an episode's environment step may take longer (``environment.step_timeout_s``:
    an episode's group waits on its environment, not on the engine, meanwhile)."""
    return max(STALL_S, step_timeout_s + 60.0)


def engine_progressing(running: int, syncing: bool, since_progress_s: float, stall_s: float = STALL_S) -> bool:
    """Whether an engine with ``running`` groups in hand, loading weights or not, that last made progress (a token,
    or a spell idle or loading weights) ``since_progress_s`` ago, makes progress."""
    return running == 0 or syncing or since_progress_s < stall_s


def alive_file() -> Path | None:
    """The file to touch (``$ASYNCRL_ALIVE_FILE``), or None where no liveness check reads one."""
    path = os.environ.get(ALIVE_ENV, "")
    return Path(path) if path else None


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
