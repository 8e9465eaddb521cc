"""Moving weights from the learner to every actor: flat dtype buckets over one torch.distributed group.

The learner (rank 0) and each actor's vLLM worker (ranks 1..N) form a group through a store in the
run's Redis (:class:`common.rendezvous.RedisStore`: only a holder of the run's Redis password can join
or write). A group is formed once per *epoch* (a membership); its store keys live under
``asyncrl/<epoch>/`` so that a re-formed group never reads a stale key. Weights go as a
few large broadcasts — parameters of one dtype packed back to back into buckets of at most
``bucket_bytes`` — rather than one call per parameter, the known bottleneck of per-parameter
designs. Gloo on CPUs, NCCL on GPUs: the same code.

Every collective has a time limit; a member that misses it raises :class:`WeightSyncError`
on the survivors, who drop it at the next formation. Each formation starts with a small test
broadcast whose checksum every member verifies (the communication self-check).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch

from common.rendezvous import RedisStore
from common.wire import WeightBucket

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
_SELF_CHECK_NUMEL = 1024


class WeightSyncError(RuntimeError):
    """A weight-group collective failed or timed out."""


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def plan_buckets(params: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[WeightBucket]:
    """Group parameters by dtype into buckets of at most ``bucket_bytes`` (a larger parameter gets its own)."""
    buckets: list[WeightBucket] = []
    by_dtype: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in params.items():
        by_dtype.setdefault(_DTYPE_NAMES[tensor.dtype], []).append((name, tensor))
    for dtype, items in by_dtype.items():
        itemsize = torch_dtype(dtype).itemsize
        names: list[str] = []
        shapes: list[list[int]] = []
        offsets: list[int] = []
        numel = 0
        for name, tensor in items:
            if names and (numel + tensor.numel()) * itemsize > bucket_bytes:
                buckets.append(WeightBucket(dtype=dtype, numel=numel, names=names, shapes=shapes, offsets=offsets))
                names, shapes, offsets, numel = [], [], [], 0
            names.append(name)
            shapes.append(list(tensor.shape))
            offsets.append(numel)
            numel += tensor.numel()
        buckets.append(WeightBucket(dtype=dtype, numel=numel, names=names, shapes=shapes, offsets=offsets))
    return buckets


def pack_bucket(bucket: WeightBucket, params: Mapping[str, torch.Tensor], device: str = "cpu") -> torch.Tensor:
    """One flat tensor holding the bucket's parameters back to back (a copy: training may go on)."""
    flat = torch.empty(bucket.numel, dtype=torch_dtype(bucket.dtype), device=device)
    for name, offset in zip(bucket.names, bucket.offsets, strict=True):
        source = params[name].detach()
        flat[offset : offset + source.numel()].copy_(source.reshape(-1))
    return flat


def unpack_bucket(bucket: WeightBucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every parameter of a received bucket; the views share ``flat``'s memory."""
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets, strict=True):
        yield name, flat[offset : offset + math.prod(shape)].view(shape)


@dataclass(frozen=True)
class GroupAddress:
    """Where and as whom to join one formation of the weight group."""

    redis_url: str
    """The run's Redis, where the rendezvous store lives (its password admits the member)."""
    run: str
    epoch: int
    rank: int
    world_size: int
    timeout_s: float = 60.0
    backend: str = "gloo"


class WeightGroup:
    """One formation of the learner + actors group; rank 0 (the learner) is the broadcast root."""

    def __init__(self, address: GroupAddress, store: torch.distributed.Store | None = None) -> None:
        self.address = address
        timeout = timedelta(seconds=address.timeout_s)
        self._own_store = store is None
        if store is None:
            store = RedisStore.connect(address.redis_url, address.run, address.timeout_s)
        self._store = store  # keep the connection alive as long as the group
        self.store = torch.distributed.PrefixStore(f"asyncrl/{address.epoch}/", store)
        self.device = "cuda" if address.backend == "nccl" else "cpu"
        self.group = None
        try:
            self.group = self._make_group(self.store, timeout)
        except BaseException:
            self.close()
            raise

    def _make_group(self, store, timeout: timedelta):
        a = self.address
        try:
            if a.rank > 0:
                # Say "I came" before the rendezvous: if it times out, the root knows whom to evict.
                store.set(f"joined/{a.rank}", "1")
            if a.backend == "nccl":
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return torch.distributed.ProcessGroupNCCL(store, a.rank, a.world_size, options)
            return torch.distributed.ProcessGroupGloo(store, a.rank, a.world_size, timeout)
        except Exception as exc:
            raise WeightSyncError(f"could not form weight group epoch {a.epoch} as rank {a.rank}: {exc}") from exc

    def close(self) -> None:
        """Drop the process group and close the store connection this group opened (a member's)."""
        self.group = None
        if self._own_store and isinstance(self._store, RedisStore):
            self._store.close()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from rank 0 in place; raises :class:`WeightSyncError` past the time limit."""
        return self._wait(self._start(tensor), tensor)

    def _start(self, tensor: torch.Tensor):
        """Post an asynchronous broadcast of ``tensor`` (collectives run in the order they are posted)."""
        try:
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 0
            options.timeout = timedelta(seconds=self.address.timeout_s)
            return self.group.broadcast([tensor], options)
        except Exception as exc:
            raise WeightSyncError(f"broadcast failed in epoch {self.address.epoch}: {exc}") from exc

    def _wait(self, work, tensor: torch.Tensor) -> torch.Tensor:
        try:
            if not work.wait(timedelta(seconds=self.address.timeout_s)):
                raise WeightSyncError(f"broadcast timed out after {self.address.timeout_s}s")
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"broadcast failed in epoch {self.address.epoch}: {exc}") from exc
        return tensor

    def self_check(self) -> float:
        """Broadcast a known tensor and verify it arrived intact; returns the seconds it took."""
        start = time.perf_counter()
        expected = torch.arange(_SELF_CHECK_NUMEL, dtype=torch.float32, device=self.device) * (self.address.epoch + 1)
        received = expected.clone() if self.address.rank == 0 else torch.zeros_like(expected)
        self.broadcast(received)
        if not torch.equal(received, expected):
            raise WeightSyncError(
                f"self-check of epoch {self.address.epoch}: checksum mismatch on rank "
                f"{self.address.rank} ({received.sum().item()} != {expected.sum().item()})"
            )
        return time.perf_counter() - start

    def send(self, buckets: Iterable[WeightBucket], params: Mapping[str, torch.Tensor]) -> int:
        """Root: broadcast every bucket of ``params``; returns the bytes sent.

        Pipelined: bucket k+1 is packed (lazily) while bucket k is on the wire.
        """
        return self.send_packed(pack_bucket(bucket, params, self.device) for bucket in buckets)

    def send_packed(self, flats: Iterable[torch.Tensor]) -> int:
        """Root: broadcast buckets already packed by :func:`pack_bucket` (at most two in flight); returns bytes."""
        sent = 0
        in_flight = None
        for flat in flats:
            work = self._start(flat)
            if in_flight is not None:
                self._wait(*in_flight)
            in_flight = (work, flat)
            sent += flat.numel() * flat.element_size()
        if in_flight is not None:
            self._wait(*in_flight)
        return sent

    def receive(self, buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
        """Member: yield (name, tensor) bucket after bucket (lazy).

        Pipelined: the receive of bucket k+1 is posted before bucket k's tensors are handed to the
        consumer (vLLM's loader), so the transfer of the next bucket overlaps the loading of this one.
        """
        pending = None
        for bucket in buckets:
            flat = torch.empty(bucket.numel, dtype=torch_dtype(bucket.dtype), device=self.device)
            work = self._start(flat)
            if pending is not None:
                yield from self._arrived(*pending)
            pending = (bucket, work, flat)
        if pending is not None:
            yield from self._arrived(*pending)

    def _arrived(self, bucket: WeightBucket, work, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield from unpack_bucket(bucket, self._wait(work, flat))


def absent_ranks(store: torch.distributed.Store, epoch: int, world_size: int) -> list[int]:
    """Ranks (1..world-1) that never announced themselves for ``epoch``: the ones to evict after a timeout."""
    prefixed = torch.distributed.PrefixStore(f"asyncrl/{epoch}/", store)
    return [rank for rank in range(1, world_size) if not prefixed.check([f"joined/{rank}"])]
