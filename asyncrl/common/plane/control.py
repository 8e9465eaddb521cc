"""The run's control plane in Redis, by concern; each part is its own module:

- :mod:`asyncrl.common.plane.keys` — the names of every key of a run (``asyncrl:<run>:…``), :func:`connect`, the dead
  letters;
- :mod:`asyncrl.common.plane.run_record` — what the learner publishes: config, policy version, weight manifest, summary,
  alerts;
- :mod:`asyncrl.common.plane.prompt_ledger` — the prompt queue, the in-flight ledger, issue records, the dispatcher's
  counters;
- :mod:`asyncrl.common.plane.process_registry` — heartbeats of every process, and where each serves ``/metrics``.

:class:`ControlPlane` holds one of each for a run (``plane.run``, ``plane.prompts``, ``plane.registry``) and the
queue depths, which span them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.process_registry import ProcessRegistry
from asyncrl.common.plane.prompt_ledger import PromptLedger
from asyncrl.common.plane.run_record import RunRecord
from asyncrl.common.wire.messages import Limits

if TYPE_CHECKING:
    import redis


class ControlPlane:
    """One run's keys in Redis, by concern: ``run`` (:class:`~asyncrl.common.plane.run_record.RunRecord`: config,
    version, weight manifest, summary, alerts), ``prompts`` (:class:`~asyncrl.common.plane.prompt_ledger.PromptLedger`:
    queue, ledger, issue records, dispatcher counters) and ``registry``
    (:class:`~asyncrl.common.plane.process_registry.ProcessRegistry`: heartbeats, ``/metrics`` endpoints);
    :meth:`queue_depths` spans them."""

    def __init__(self, client: redis.Redis, run: str, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = RunKeys(run)
        self.run = RunRecord(client, self.keys, limits)
        self.prompts = PromptLedger(client, self.keys, limits)
        self.registry = ProcessRegistry(client, self.keys, limits)

    def queue_depths(self) -> dict[str, int]:
        """Groups queued (``prompts``), issued and not yet trained (``inflight``), entries in the replay stream
        (``replay``: its length, acknowledged entries included until trimmed), read but not acknowledged
        (``replay_pending``), dead letters, and — where Redis ≥ 7 reports the consumer group's lag — entries not yet
        delivered to the learner (``replay_unread``). Two round trips."""
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(self.keys.prompts)
        pipe.hlen(self.keys.inflight)
        pipe.xlen(self.keys.replay)
        pipe.xlen(self.keys.dead)
        prompts, inflight, replay, dead = (int(n) for n in pipe.execute())
        depths = {"prompts": prompts, "inflight": inflight, "replay": replay, "replay_pending": 0, "dead_letters": dead}
        if replay or self.client.exists(self.keys.replay):
            groups = self.client.xinfo_groups(self.keys.replay)
            depths["replay_pending"] = sum(int(g["pending"]) for g in groups)
            lags = [g.get("lag") for g in groups]
            known = [lag for lag in lags if isinstance(lag, int)]  # a lag Redis cannot tell is nil
            if lags and len(known) == len(lags):
                depths["replay_unread"] = max(known)
        return depths
