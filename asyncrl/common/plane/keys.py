"""The names of a run's Redis keys and the connection every process opens.

Every key of a run lives under ``asyncrl:<run>:`` (:class:`RunKeys`), so several runs can share one Redis and
``redis-cli --scan --pattern 'asyncrl:<run>:*'`` shows everything of one. What a process cannot accept goes to the
``dead`` stream (``common/plane/dead_letters.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis


@dataclass(frozen=True)
class RunKeys:
    """The names of every Redis key of one run."""

    run: str

    def _k(self, name: str) -> str:
        return f"asyncrl:{self.run}:{name}"

    @property
    def config(self) -> str:
        return self._k("config")

    @property
    def secret(self) -> str:
        """The run secret that seals data-plane messages and keys group ids (``common/wire/seal.py``); never
        published."""
        return self._k("secret")

    @property
    def version(self) -> str:
        return self._k("version")

    @property
    def sending(self) -> str:
        """The newest version the learner has started to send (``version`` is the newest it finished sending): a
        group issued at a version on its way is generated with it (``actors/rollout.py``)."""
        return self._k("sending")

    @property
    def finished(self) -> str:
        """The step a run completed at, set when its learner took its last step: its actors and workers then exit."""
        return self._k("finished")

    @property
    def actors_wanted(self) -> str:
        """A list whose length is the number of rollout actors the run wants (``learner/intake/autoscale.py``): KEDA's
        redis scaler reads a list's length (LLEN) and nothing else, so the number is kept in that form."""
        return self._k("actors_wanted")

    @property
    def manifest(self) -> str:
        return self._k("manifest")

    def formation_manifests(self, epoch: int) -> str:
        """Hash: broadcast position → manifest, for one weight-group formation (its newest few; a resume from a
        checkpoint re-sends within the same formation). Members read it in order (``RunRecord.formation_manifest``)."""
        return self._k(f"manifests:{epoch}")

    @property
    def manifest_channel(self) -> str:
        """Pub/sub channel on which a new manifest is announced (its payload is the version)."""
        return self._k("manifest:announce")

    @property
    def digests(self) -> str:
        """Hash: policy version → the digest of the weights sent as that version (``WeightManifest.digest``)."""
        return self._k("digests")

    @property
    def samples(self) -> str:
        """JSON list of the newest rows of samples.jsonl (``learner/record/samples.py``)."""
        return self._k("samples")

    @property
    def trained(self) -> str:
        """Hash: group id → the step that trained it (``learner/intake/trained.py``)."""
        return self._k("trained")

    @property
    def unacked(self) -> str:
        """Hash: replay entry id → ``[step, group id]`` of a trained entry whose acknowledgement waits for the
        checkpoint that holds its step (``learner/intake/trained.py``)."""
        return self._k("unacked")

    @property
    def processes(self) -> str:
        return self._k("processes")

    def heartbeat(self, process_id: str) -> str:
        return self._k(f"heartbeat:{process_id}")

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def eval_prompts(self) -> str:
        """The eval prompt queue: actors pop it before ``prompts`` (``common/plane/prompt_ledger.py: take_prompts``)."""
        return self._k("eval_prompts")

    @property
    def eval(self) -> str:
        """JSON list of the newest eval rounds' ``eval/*`` figures (``learner/intake/evaluation.py``), for rl-top."""
        return self._k("eval")

    @property
    def inflight(self) -> str:
        return self._k("inflight")

    @property
    def replay(self) -> str:
        return self._k("replay")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def refused(self) -> str:
        """List of the ids of groups the reward workers dead-lettered for good, for the learner's
        dispatcher to retire at once (``learner/intake/dispatcher.py: retire_refused``)."""
        return self._k("refused")

    @property
    def faults(self) -> str:
        """Hash: group id → how many times an environment fault ended one of its episodes (``fault_attempts``)."""
        return self._k("faults")

    @property
    def groups(self) -> str:
        """Hash: group id → encoded :class:`PromptGroup` of every issued group not yet completed or lost."""
        return self._k("groups")

    @property
    def dispatch(self) -> str:
        """Hash of the dispatcher's counters (see ``learner/intake/dispatcher.py``)."""
        return self._k("dispatch")

    def once(self, token: str) -> str:
        """One-time token of a change to the dispatcher's counters, so a retried one adds nothing
        (``common/plane/prompt_ledger.py: add_counts``); expires after a day."""
        return self._k(f"once:{token}")

    @property
    def done(self) -> str:
        """Set of the ids of completed groups (to tell a late duplicate of a re-issued group)."""
        return self._k("done")

    @property
    def summary(self) -> str:
        """JSON of the learner's latest step (a subset of its metrics.jsonl row), for rl-top."""
        return self._k("summary")

    @property
    def alerts(self) -> str:
        """JSON list of the alerts the learner's health check holds active now."""
        return self._k("alerts")

    @property
    def audit(self) -> str:
        """Stream of the run's audit trail (``common/plane/audit.py``), mirrored by the learner into
        ``audit.jsonl``."""
        return self._k("audit")


def connect(url: str, outage_s: float | None = None) -> redis.Redis:
    """The Redis client of every process: it lives through a Redis restart and gives up after ``outage_s``.

    A command that fails on a connection error (Redis killed, restarting, loading its AOF) is retried with back-off
    until Redis answers again, for at most ``outage_s`` seconds of outage (default: ``transport.redis_outage_s``'s);
    then it raises :class:`asyncrl.common.plane.outage.RedisUnavailable` (see ``common/plane/outage.py`` for why
    retrying is safe).

    Replies are parsed by hiredis when it is installed (fast for the replay stream's large
    entries), but commands are always packed by redis-py's Python serializer: it sends values
    above 6 kB as separate buffers, where hiredis's packer copies every 100 kB group once more.
    """
    import redis

    # Encoder is where redis-py's own connections take it from; the module does not list it as an export.
    from redis.connection import Encoder, PythonRespSerializer  # pyright: ignore[reportPrivateImportUsage]

    from asyncrl.common.config import TransportSection
    from asyncrl.common.plane.outage import OutageClock, OutageRetry

    limit_s = TransportSection().redis_outage_s if outage_s is None else outage_s
    retry = OutageRetry(OutageClock(limit_s, address=url.rpartition("@")[2]))
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis.from_url(
        url, socket_connect_timeout=5, health_check_interval=30, command_packer=packer, retry=retry
    )
