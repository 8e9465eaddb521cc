"""OpenMP threads that sleep while they wait, in every process of a run.

torch's CPU kernels (the learner's, and vLLM's on CPUs) run on OpenMP. By default a thread that has finished its share
of a parallel region spins until the others finish theirs (OpenMP's active wait policy). That is the fastest choice
when a process has its cores to itself and the worst when processes share cores, as a learner, its actors' engines and
a reward worker do on one machine: a spinning thread holds the core the thread it waits for needs, so each parallel
region lasts until the scheduler preempts the spinner. On the demo (2 cores, two actors, the learner, a reward
worker) training took 0.65-1.3 s a step where the same step alone takes 0.065 s; with passive waits it took 0.05 s,
and a whole step 0.14 s instead of 0.7 s (rollout.cpu_single_process = true; 0.34 s instead of 1.27 s with vLLM's
separate worker).

OpenMP reads ``OMP_WAIT_POLICY`` once, when its runtime loads with torch, so each command line sets it before anything
imports torch (``rl-learner`` and ``rl-actor``, whichever launcher starts them), and the processes it starts (vLLM's
engine processes) inherit it. An operator's own ``OMP_WAIT_POLICY`` is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"


def passive_waits() -> None:
    """Make OpenMP threads of this process, and of the processes it starts, sleep when they wait (unless set)."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")
