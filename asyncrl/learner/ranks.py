"""Learner ranks beyond the first: rank 0 leads the run, every other rank follows it step by step.

``rl-learner train`` under ``torchrun`` (or the ``deepspeed`` launcher) with N ranks is the same program as with one:
rank 0 owns everything that talks to the outside — Redis, admission, the replay consumer, the run state of
checkpoints, metrics, the audit trail and the broadcast — and ranks 1…N−1 hold only the engines. What the engines do
is collective (DeepSpeed's gradient reduction, ZeRO-3's parameter gathers, checkpoint saves), so before rank 0 does
any of it, it tells the others with one command on a gloo group of its own (:func:`lead`), and they do the same
(:func:`asyncrl.learner.follower.follow`)::

    train     the step's whole TrainBatch    every rank: π_old and advantages over the batch, then its shard's
                                             backward (learner/update/policy.py); the gradient is the sum of the shards'
    params    (ZeRO-3 only)                  every rank takes part in the bucket-by-bucket gather for the broadcast
    save      the SavedState                 every rank writes its DeepSpeed shard; rank 0 the rest and the manifest
    restore   the verified Checkpoint        every rank loads its shard, the KL coefficient and its own RNG
    lr        a factor                       health's lr cut, applied to every rank's scheduler
    stop      —                              the followers return

The commands are pickled Python objects sent with ``broadcast_object_list`` from rank 0 only: the ranks of one
learner trust each other (the group is the launcher's, on the learner's own hosts). A follower whose leader died
sees the gloo connection close and exits non-zero, and the launcher (torchrun) ends the others; a dead follower
makes rank 0's next collective fail the same way. Either way the run resumes from its last checkpoint with the same
number of ranks (a checkpoint records its ranks; another number is refused: DeepSpeed's ZeRO state is partitioned
by rank).

**Where the ranks meet.** One rank (``rl-learner train``, ``rl-launch``) starts its default group on an in-process
store, with nothing listening beyond loopback (:func:`asyncrl.learner.dist.init_distributed`). Several ranks meet on the
launcher's store: torchrun's agent runs a TCPStore on ``--master-port`` (static rendezvous) or on the
``--rdzv-endpoint`` port (``--standalone`` picks a free one), and a TCPStore server accepts connections on every
interface whatever ``--master-addr`` says, with no password. So on one host use ``--standalone`` (or
``--master-addr 127.0.0.1``) and keep that port closed to other hosts (a firewall; on Kubernetes the learner's
NetworkPolicy); across hosts, run the ranks on a network only the learner's hosts reach.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.common.observability.logs import get_logger
from asyncrl.learner import dist

log = get_logger("learner")

COMMANDS = ("train", "params", "save", "restore", "lr", "stop")
_group: Any = None  # the gloo group the commands travel on (made by start(), on every rank)


def start() -> None:
    """Start the process group and the command group; collective: every rank calls it once, before any engine."""
    global _group
    dist.init_distributed()
    if dist.world_size() > 1 and _group is None:
        # gloo whatever the training backend: commands are small pickles, and NCCL would need them on a GPU
        _group = torch.distributed.new_group(backend="gloo")


def leading() -> bool:
    """This process is rank 0 of several: what it does to the engines, it must first :func:`lead`."""
    return _group is not None and dist.rank() == 0


def lead(command: str, payload: Any = None) -> None:
    """On rank 0 of several: tell every follower to do ``command`` with ``payload`` now. Elsewhere: nothing."""
    if command not in COMMANDS:
        raise ValueError(f"unknown rank command {command!r}; known: {', '.join(COMMANDS)}")
    if leading():
        torch.distributed.broadcast_object_list([command, payload], src=0, group=_group)


def release() -> None:
    """Rank 0 at its end, however it ends: the followers stop (a rank already gone cannot be told: nothing to do)."""
    try:
        lead("stop")
    except Exception as exc:
        if not lost_rank(exc):
            raise


def lost_rank(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank is gone (gloo: the connection closed; NCCL:
    a communicator error or timeout)."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(word in text for word in ("gloo", "Gloo", "NCCL", "Connection closed"))


def say_lost(exc: BaseException) -> None:
    """The error a person reads when a learner rank is gone: which rank saw it, and how to go on."""
    log.error(
        "a learner rank failed; stopping every rank",
        rank=dist.rank(),
        world_size=dist.world_size(),
        error=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
        action=f"find the failed rank in the launcher's summary, then resume with {dist.world_size()} ranks: "
        "torchrun … rl-learner train CONFIG --resume latest",
    )


def receive() -> tuple[str, Any]:
    """A follower's next command from rank 0 (blocks until rank 0 leads one)."""
    message: list[Any] = [None, None]
    torch.distributed.broadcast_object_list(message, src=0, group=_group)
    return message[0], message[1]
