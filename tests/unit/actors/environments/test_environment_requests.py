"""What crosses the wire between an actor and a reward worker that serves environments: an actor's request carries
the episode key and the row or the turn, never which environment to make; a worker refuses anything else, naming
what is wrong."""

from __future__ import annotations

import pytest

from asyncrl.actors.environments.remote import _wire_fields
from asyncrl.actors.environments.service import BadRequest, request_fields

ROW = {"prompt": "What is 6*7?", "answer": "42", "extra": {}, "seed": 7}


def test_a_make_request_carries_the_row_and_never_the_environment() -> None:
    fields = {"episode": "e1", "name": "os:system", "options": {"how": "rm"}, "row": ROW}
    assert _wire_fields("make", fields) == {"episode": "e1", "row": ROW}
    identity = {"group_id": "g-1", "index": 3}  # which episode it is for: what a worker signs its answers for
    assert _wire_fields("make", {**fields, "identity": identity}) == {"episode": "e1", "row": ROW, "identity": identity}
    assert _wire_fields("step", {"episode": "e1", "action": "hi"}) == {"episode": "e1", "action": "hi"}
    assert _wire_fields("score", {"episode": "e1"}) == {"episode": "e1"}


def test_a_worker_takes_only_the_fields_it_needs() -> None:
    assert request_fields({"id": 1, "op": "make", "episode": "e1", "row": ROW, "name": "os:system"}) == {"row": ROW}
    identity = {"group_id": "g-1", "index": 0}
    made = request_fields({"id": 1, "op": "make", "episode": "e1", "row": ROW, "identity": identity})
    assert made == {"row": ROW, "identity": identity}
    assert request_fields({"id": 2, "op": "step", "episode": "e1", "action": "x"}) == {"action": "x"}
    assert request_fields({"id": 3, "op": "score", "episode": "e1"}) == {}


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        ({"op": "exec", "episode": "e1"}, "op must be one of make, step, score, close"),
        ({"op": "step", "episode": ""}, "episode must be a key"),
        ({"op": "step", "episode": "e" * 200, "action": "x"}, "episode must be a key"),
        ({"op": "make", "episode": "e1", "row": {"prompt": "x"}}, "make needs a row"),
        ({"op": "make", "episode": "e1", "row": "x"}, "make needs a row"),
        ({"op": "step", "episode": "e1", "action": 3}, "step needs an action"),
        ({"op": "step", "episode": "e1", "action": "x" * 1_000_001}, "step needs an action"),
        ({"op": "make", "episode": "e1", "row": ROW, "identity": {"group_id": "g", "index": -1}}, "identity must"),
        ({"op": "make", "episode": "e1", "row": ROW, "identity": {"group_id": "g", "index": True}}, "identity must"),
        ({"op": "make", "episode": "e1", "row": ROW, "identity": {"group_id": "", "index": 0}}, "identity must"),
        ({"op": "make", "episode": "e1", "row": ROW, "identity": {"group_id": "g"}}, "identity must"),
        ({"op": "make", "episode": "e1", "row": ROW, "identity": "g/0"}, "identity must"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(request_: dict, names: str) -> None:
    with pytest.raises(BadRequest, match=names):
        request_fields({"id": 1, **request_})
