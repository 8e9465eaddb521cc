"""The weight group on real gloo: flat buckets reach every member intact; nobody waits forever."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.redis_server import free_port
from common.weights import GroupAddress, WeightGroup, WeightSyncError, host_store, plan_buckets, unpack_bucket

pytestmark = pytest.mark.integration


def make_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=gen),
        "layer.0.w": torch.randn(16, 16, generator=gen),
        "layer.0.norm": torch.randn(16, generator=gen).to(torch.bfloat16),
        "head.weight": torch.randn(50, 16, generator=gen),
    }


def member(port: int, rank: int, world: int, buckets, out: mp.Queue) -> None:
    group = WeightGroup(GroupAddress("127.0.0.1", port, epoch=1, rank=rank, world_size=world, timeout_s=30))
    group.self_check()
    out.put({name: tensor.clone() for name, tensor in group.receive(buckets)})


def test_buckets_reach_every_member_intact() -> None:
    params = make_params()
    buckets = plan_buckets(params, bucket_bytes=4 * 16 * 60)  # small: several buckets per dtype
    assert len(buckets) >= 3 and {b.dtype for b in buckets} == {"float32", "bfloat16"}
    port = free_port()
    store = host_store("127.0.0.1", port)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    members = [ctx.Process(target=member, args=(port, r, 3, buckets, out)) for r in (1, 2)]
    for proc in members:
        proc.start()
    try:
        root = WeightGroup(GroupAddress("127.0.0.1", port, epoch=1, rank=0, world_size=3, timeout_s=30), store)
        assert root.self_check() >= 0
        assert root.send(buckets, params) == sum(t.numel() * t.element_size() for t in params.values())
        for _ in members:
            received = out.get(timeout=60)
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


def test_a_missing_member_times_out_instead_of_hanging() -> None:
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=5)
    with pytest.raises(WeightSyncError):  # raises after the 2 s limit; a hang would trip pytest's timeout
        root = WeightGroup(GroupAddress("127.0.0.1", port, epoch=7, rank=0, world_size=2, timeout_s=2), store)
        root.self_check()
