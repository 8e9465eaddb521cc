"""A follower rank's whole life (ranks 1…N−1 of a learner): the same engines as rank 0's, driven by the commands rank 0
leads on the rank channel (:mod:`asyncrl.learner.ranks`, which lists them) until ``stop``.

It lives apart from the channel because it needs the engines (``learner/update/policy.py``,
``learner/checkpoint/checkpointer.py``), which themselves lead commands through the channel.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from asyncrl.common.observability.logs import get_logger
from asyncrl.learner import dist
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.checkpoint.checkpointer import Checkpointer
from asyncrl.learner.checkpoint.format import restore_rng
from asyncrl.learner.health.monitor import scale_lr_schedule
from asyncrl.learner.ranks import lost_rank, receive, say_lost
from asyncrl.learner.update.policy import PolicyUpdate

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig

log = get_logger("learner")


def follow(config: RunConfig) -> None:
    """A follower's whole life (ranks 1…N−1): the same engines as rank 0's, driven by its commands until ``stop``."""
    # A launcher's SIGTERM reaches every rank; rank 0 answers it with a checkpoint, which needs the followers.
    signal.signal(signal.SIGTERM, lambda signum, frame: log.info("SIGTERM: following rank 0 to its checkpoint"))
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    update = PolicyUpdate(config, assemble(config), tokenizer.pad_token_id or 0)
    checkpointer = Checkpointer(config, update.engine, update.critic, tokenizer)
    log.info("learner rank following rank 0", rank=dist.rank(), world_size=dist.world_size())
    steps = 0
    while True:
        try:
            command, payload = receive()
        except Exception as exc:
            if lost_rank(exc):
                say_lost(exc)
            raise
        if command == "train":
            update.train(payload)
            steps += 1
        elif command == "params":
            update.params()
        elif command == "save":
            checkpointer.save(payload)
        elif command == "restore":
            state = checkpointer.load(payload)
            update.restore_kl_coef(state.kl_coef)
            restore_rng(state.rank_rngs[dist.rank() - 1])
        elif command == "lr":
            scale_lr_schedule(update.engine.engine.lr_scheduler, [config.learner.lr], payload)
        elif command == "stop":
            log.info("learner rank stopped with rank 0", rank=dist.rank(), steps=steps)
            return
        else:  # a newer rank 0 than this code: stopping beats training on something else
            raise RuntimeError(f"rank 0 sent an unknown command {command!r}; run the same asyncrl on every rank")
