"""What the learner publishes about a run in Redis, for every other process: the resolved config, the policy
version, the weight manifest, the step summary rl-top shows, and the active alerts.

Keys (:class:`asyncrl.common.plane.control.RunKeys`): ``config`` (JSON), ``version``, ``manifest`` (an encoded
:class:`~asyncrl.common.wire.messages.WeightManifest`, announced on ``manifest:announce``), ``summary`` (JSON),
``alerts`` (JSON). A subscriber that misses an announcement re-reads the key later: it only waits longer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from asyncrl.common.config import RunConfig
from asyncrl.common.plane import replies
from asyncrl.common.wire.messages import Decoder, Limits, WeightManifest, encode_blob, unpack_frames

FORMATION_MANIFESTS_KEPT = 8
FORMATION_MANIFESTS_TTL_S = 24 * 3600  # a formation's manifests outlive any member's read of them

if TYPE_CHECKING:
    import redis

    from asyncrl.common.plane.keys import RunKeys


class RunNotFoundError(LookupError):
    """The run has no published config in this Redis."""


class RunRecord:
    """The run's published state (``plane.run``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = keys
        self._manifest_decoder = Decoder(WeightManifest, limits)

    def publish_config(self, config: RunConfig) -> None:
        """The run's config, for every process; a run whose config is published again runs (again)."""
        with self.client.pipeline() as pipe:
            pipe.set(self.keys.config, config.to_json())
            pipe.delete(self.keys.finished)
            pipe.execute()

    def read_config(self) -> RunConfig:
        raw = self.client.get(self.keys.config)
        if raw is None:
            raise RunNotFoundError(
                f"no run {self.keys.run!r} in this Redis: start `rl-learner` for it first, or check --run and --redis"
            )
        return RunConfig.from_json(raw)

    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def set_version(self, version: int) -> None:
        self.client.set(self.keys.version, version)

    def sending(self) -> int:
        """The newest version the learner started to send; the published :meth:`version` when none is on its way."""
        raw = self.client.get(self.keys.sending)
        return self.version() if raw is None else int(raw)

    def set_sending(self, version: int) -> None:
        self.client.set(self.keys.sending, version)

    def mark_finished(self, step: int) -> None:
        """Say the run completed at ``step``: its actors and reward workers exit, and it wants no actor (an autoscaler
        scales them to zero)."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.finished, step)
            pipe.delete(self.keys.actors_wanted)
            pipe.execute()

    def set_actors_wanted(self, count: int) -> None:
        """Make the :attr:`RunKeys.actors_wanted` list ``count`` entries long, in one transaction (an autoscaler never
        reads it half made)."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.actors_wanted)
            if count > 0:
                pipe.rpush(self.keys.actors_wanted, *[b"1"] * count)
            pipe.execute()

    def actors_wanted(self) -> int:
        return int(self.client.llen(self.keys.actors_wanted))

    def finished(self) -> int | None:
        """The step the run completed at, or None while it runs."""
        raw = self.client.get(self.keys.finished)
        return None if raw is None else int(raw)

    def publish_manifest(self, manifest: WeightManifest, position: int) -> None:
        """Store the manifest and its version's digest, then announce it (subscribers re-read the key, so a missed
        announcement only delays). ``position`` is the broadcast's place in its formation (0 is the first): members
        read the formation's manifests in that order (:meth:`formation_manifest`)."""
        with self.client.pipeline(transaction=True) as pipe:
            blob = encode_blob(manifest)
            pipe.set(self.keys.manifest, blob)
            formation = self.keys.formation_manifests(manifest.group_epoch)
            pipe.hset(formation, str(position), blob)
            if position >= FORMATION_MANIFESTS_KEPT:  # a member is at most a broadcast or two behind the learner
                pipe.hdel(formation, str(position - FORMATION_MANIFESTS_KEPT))
            pipe.expire(formation, FORMATION_MANIFESTS_TTL_S)
            if manifest.digest:
                pipe.hset(self.keys.digests, str(manifest.version), manifest.digest)
            pipe.publish(self.keys.manifest_channel, str(manifest.version))
            pipe.execute()

    def digests(self) -> dict[int, str]:
        """Version → the digest of the weights the learner last sent as that version (a resume re-sends some
        versions with other weights; the newest send wins, so an actor still serving the discarded ones stands out)."""
        return {int(v): d.decode() for v, d in replies.blob_map(self.client.hgetall(self.keys.digests)).items()}

    def read_manifest(self) -> tuple[WeightManifest, list[memoryview]] | None:
        """The current manifest and its frames (to hand on to a vLLM worker), or None before the first."""
        return self._decode_manifest(replies.maybe_blob(self.client.get(self.keys.manifest)))

    def formation_manifest(self, epoch: int, position: int) -> tuple[WeightManifest, list[memoryview]] | None:
        """The manifest of a formation's ``position``-th broadcast (0 is its first), or None if not published yet."""
        return self._decode_manifest(
            replies.maybe_blob(self.client.hget(self.keys.formation_manifests(epoch), str(position)))
        )

    def _decode_manifest(self, blob: bytes | None) -> tuple[WeightManifest, list[memoryview]] | None:
        if blob is None:
            return None
        frames = unpack_frames(blob)
        return self._manifest_decoder.decode(frames), frames

    def publish_samples(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The newest rows of samples.jsonl (``learner/record/samples.py``), for rl-top."""
        self.client.set(self.keys.samples, json.dumps(list(rows)))

    def samples(self) -> list[dict[str, Any]]:
        raw = self.client.get(self.keys.samples)
        return json.loads(raw) if raw is not None else []

    def publish_summary(self, summary: Mapping[str, Any]) -> None:
        self.client.set(self.keys.summary, json.dumps(dict(summary)))

    def summary(self) -> dict[str, Any] | None:
        """The learner's latest-step summary, or None before its first step."""
        raw = self.client.get(self.keys.summary)
        return json.loads(raw) if raw is not None else None

    def set_alerts(self, alerts: Iterable[Mapping[str, Any]]) -> None:
        """Replace the run's active alerts. Each is a JSON object with ``name`` (str) and, by convention,
        ``severity`` (``warning``/``critical``), ``message`` (for a person) and ``since`` (Unix time)."""
        items = [dict(a) for a in alerts]
        for item in items:
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError(f"an alert needs a non-empty string 'name': {item!r}")
        self.client.set(self.keys.alerts, json.dumps(items))

    def alerts(self) -> list[dict[str, Any]]:
        """The active alerts (empty when none, or when no health check has written any)."""
        raw = self.client.get(self.keys.alerts)
        return json.loads(raw) if raw is not None else []
