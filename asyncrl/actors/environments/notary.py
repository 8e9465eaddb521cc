"""A reward worker's signature on what an environment that cannot be replayed said (``common/wire/attestation.py``).

:class:`Notary` keeps, for each environment the worker's environment service holds, which episode it was made for
(the group id and index of the actor's ``make``, bound here once and never read from a later request), the worker's
random id of that environment and how many steps it has taken. It adds the worker's public key and that id to the
``make`` answer, and a signature to each ``step`` and ``score`` answer. It runs in the worker's own process, where
the private key is; the environment runs in the worker's environment process, which never sees the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.common.wire.attestation import EpisodeIdentity, Signer, new_episode_id, score_message, step_message


@dataclass
class _Held:
    identity: EpisodeIdentity
    turns: int = 0


class Notary:
    """Signs the answers of one run's environments (module docstring). ``made`` before anything else of an
    environment; ``step`` and ``score`` answers of one environment come one at a time (its actor waits for each)."""

    def __init__(self, signer: Signer, run: str) -> None:
        self.signer, self.run = signer, run
        self._held: dict[str, _Held] = {}

    def made(self, key: str, identity: dict[str, Any]) -> dict[str, str]:
        """What the ``make`` answer of environment ``key``, made for the episode ``identity`` names (``group_id``,
        ``index``), carries: this worker's public key and its new id of the environment."""
        held = _Held(EpisodeIdentity(self.run, identity["group_id"], identity["index"], new_episode_id()))
        self._held[key] = held
        return {"signer": self.signer.public_hex, "episode": held.identity.episode}

    def stepped(self, key: str, action: str, answer: dict[str, Any]) -> dict[str, Any]:
        """The ``step`` answer of environment ``key`` to ``action``, signed as its next turn."""
        held = self._held[key]
        held.turns += 1
        observation, reward, done = answer["observation"], answer["reward"], answer["done"]
        message = step_message(held.identity, held.turns, action, observation, reward, done)
        return {**answer, "signature": self.signer.sign(message)}

    def scored(self, key: str, answer: dict[str, Any]) -> dict[str, Any]:
        """The ``score`` answer of environment ``key``, signed with the number of steps it has taken."""
        held = self._held[key]
        return {**answer, "signature": self.signer.sign(score_message(held.identity, held.turns, answer["score"]))}

    def forget(self, key: str) -> None:
        self._held.pop(key, None)
