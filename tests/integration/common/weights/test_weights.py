"""The weight group on real gloo with its rendezvous in a real Redis: flat buckets reach every member intact,
nobody waits forever (nor for a formation the learner gave up), and a client without the run's Redis password can
neither join nor write."""

from __future__ import annotations

import io
import multiprocessing as mp
import threading

import pytest
import redis
import torch

from asyncrl.common.weights.group import (
    GroupAddress,
    WeightGroup,
    WeightSyncError,
    abandon_formation,
    absent_ranks,
    plan_buckets,
    unpack_bucket,
)
from asyncrl.common.weights.rendezvous import RedisStore, rendezvous_prefix
from tests.helpers.waits import wait_for


def make_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=gen),
        "layer.0.w": torch.randn(16, 16, generator=gen),
        "layer.0.norm": torch.randn(16, generator=gen).to(torch.bfloat16),
        "head.weight": torch.randn(50, 16, generator=gen),
    }


def member(url: str, rank: int, world: int, buckets, out: mp.Queue) -> None:
    group = WeightGroup(GroupAddress(url, "wg", epoch=1, rank=rank, world_size=world, timeout_s=30))
    group.self_check()
    flats = group.receive_all(buckets)
    pairs = (pair for bucket, flat in zip(buckets, flats, strict=True) for pair in unpack_bucket(bucket, flat))
    # As bytes, not tensors: a tensor crosses a queue as a shared file descriptor that only lives as long as
    # this process, which may have exited by the time the test reads it.
    buffer = io.BytesIO()
    torch.save({name: tensor.clone() for name, tensor in pairs}, buffer)
    out.put(buffer.getvalue())


def taken(out: mp.Queue) -> dict[str, torch.Tensor]:
    """What one member received, read back from the bytes it sent."""
    return torch.load(io.BytesIO(out.get(timeout=60)))


def test_buckets_reach_every_member_intact(redis_server, redis_client) -> None:
    params = make_params()
    buckets = plan_buckets(params, bucket_bytes=4 * 16 * 60)  # small: several buckets per dtype
    assert len(buckets) >= 3 and {b.dtype for b in buckets} == {"float32", "bfloat16"}
    store = RedisStore(redis_client, "wg", timeout_s=30)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    members = [ctx.Process(target=member, args=(redis_server.url, r, 3, buckets, out)) for r in (1, 2)]
    for proc in members:
        proc.start()
    try:
        root = WeightGroup(GroupAddress("", "wg", epoch=1, rank=0, world_size=3, timeout_s=30), store)
        assert root.self_check() >= 0
        assert root.send(buckets, params) == sum(t.numel() * t.element_size() for t in params.values())
        for _ in members:
            received = taken(out)
            assert received.keys() == params.keys()
            for name, tensor in params.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    finally:
        for proc in members:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert [p.exitcode for p in members] == [0, 0]


def test_unpack_gives_views_in_the_right_shapes() -> None:
    params = make_params()
    (bucket,) = [b for b in plan_buckets(params, 1 << 20) if b.dtype == "float32"]
    flat = torch.cat([params[n].reshape(-1) for n in bucket.names])
    assert {n: t.shape for n, t in unpack_bucket(bucket, flat)} == {n: params[n].shape for n in bucket.names}


def test_a_missing_member_times_out_instead_of_hanging(redis_client) -> None:
    store = RedisStore(redis_client, "wg", timeout_s=5)
    with pytest.raises(WeightSyncError):  # raises after the 2 s limit; a hang would trip pytest's timeout
        root = WeightGroup(GroupAddress("", "wg", epoch=7, rank=0, world_size=2, timeout_s=2), store)
        root.self_check()


def test_a_member_stops_waiting_once_the_learner_gave_up_its_formation(redis_server, redis_client) -> None:
    """A member waits in the rendezvous of a three-member formation whose third never comes. Once the learner marks
    the formation given up (as it does when that member's heartbeat expires), the member stops waiting within
    seconds, with the reason, instead of waiting out its 60 s limit."""
    failed: list[WeightSyncError] = []

    def join() -> None:
        try:
            WeightGroup(GroupAddress(redis_server.url, "wg", epoch=3, rank=1, world_size=3, timeout_s=60))
        except WeightSyncError as exc:
            failed.append(exc)

    member = threading.Thread(target=join, daemon=True)
    member.start()
    learner = RedisStore(redis_client, "wg", timeout_s=5)
    wait_for(lambda: absent_ranks(learner, 3, 3) == [2], "the member in the rendezvous", timeout_s=30)
    assert member.is_alive()  # waiting for the others
    abandon_formation(learner, epoch=3)
    member.join(timeout=5)
    assert not member.is_alive(), "the member still waits in a formation the learner gave up"
    assert failed and "the learner gave up on this formation" in str(failed[0]), failed


def test_the_store_behaves_as_torch_expects(redis_client) -> None:
    store = RedisStore(redis_client, "wg", timeout_s=1)
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"  # absent + expected empty: set
    assert store.compare_set("c", "y", "z") == b"x"  # wrong expectation: the current value, unchanged
    assert store.compare_set("c", "x", "z") == b"z"
    assert store.num_keys() == 3 and store.delete_key("a") and not store.delete_key("a")
    with pytest.raises(TimeoutError, match="not set within"):
        store.get("never")
    assert 0 < redis_client.ttl(rendezvous_prefix("wg") + "n") <= 3600  # formations leave nothing forever


def test_a_client_without_the_runs_password_cannot_join_or_write(redis_server, redis_client) -> None:
    """The TCPStore listened on every interface and took keys from anyone. The rendezvous is now in the
    run's Redis: a rogue without the password is refused, and nothing of the group is listening for it."""
    host_port = redis_server.url.rsplit("@", 1)[1]
    for rogue_url in (f"redis://{host_port}", f"redis://:wrong-password@{host_port}"):
        rogue = RedisStore.connect(rogue_url, "wg", timeout_s=2)
        with pytest.raises(redis.exceptions.AuthenticationError):
            rogue.set("asyncrl/1/joined/1", "1")
        with pytest.raises(WeightSyncError, match="could not form weight group"):
            WeightGroup(GroupAddress(rogue_url, "wg", epoch=1, rank=1, world_size=2, timeout_s=2))
    assert not list(redis_client.scan_iter(match=rendezvous_prefix("wg") + "*"))  # nothing was written
    # The run's own member, with the password, forms the group with the root as before.
    store = RedisStore(redis_client, "wg", timeout_s=30)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    params = make_params()
    buckets = plan_buckets(params, 1 << 20)
    proc = ctx.Process(target=member, args=(redis_server.url, 1, 2, buckets, out))
    proc.start()
    try:
        root = WeightGroup(GroupAddress("", "wg", epoch=1, rank=0, world_size=2, timeout_s=30), store)
        root.self_check()
        root.send(buckets, params)
        assert torch.equal(taken(out)["head.weight"], params["head.weight"])
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
