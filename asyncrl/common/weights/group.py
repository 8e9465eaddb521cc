"""Moving weights from the learner to every actor: flat dtype buckets over one torch.distributed group.

The learner (rank 0) and each actor's vLLM worker (ranks 1..N) form a group through a store in the
run's Redis (:class:`asyncrl.common.weights.rendezvous.RedisStore`: only a holder of the run's Redis password can join
or write). A group is formed once per *epoch* (a membership); its store keys live under
``asyncrl/<epoch>/`` so that a re-formed group never reads a stale key. Weights go as a
few large broadcasts — parameters of one dtype packed back to back into buckets of at most
``bucket_bytes`` — rather than one call per parameter, the known bottleneck of per-parameter
designs. Gloo on CPUs, NCCL on GPUs: the same code.

Every collective has a time limit; a member that misses it raises :class:`WeightSyncError`
on the survivors, who drop it at the next formation. A formation the learner gave up on (a member's heartbeat
expired, or a member never came) is marked so (:func:`abandon_formation`), and the members still waiting in its
rendezvous stop at once: they are at the next formation instead of waiting out the time limit. Each formation
starts with a small test broadcast whose checksum every member verifies (the communication self-check).

The self-check proves the transport, not the weights. Every version is also *sealed*
(:func:`seal_buckets`): the learner hashes each packed bucket, and the manifest carries the bucket
digests and one version digest over them; a member verifies every received bucket against its digest
(:func:`digest_mismatch`) before anything is loaded, so weights that changed on the way — or a manifest
that does not describe them — are never served.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import blake3
import torch
from torch.distributed.distributed_c10d import PrefixStore, Store

from asyncrl.common.net import ADVERTISE_HOST_ENV
from asyncrl.common.weights.rendezvous import RedisStore
from asyncrl.common.wire.messages import WeightBucket

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


DIGEST_BYTES = 8
"""Digests are 64-bit BLAKE3 (16 hex characters): a check of integrity, not a signature (the manifest comes from
the run's Redis, which only holders of its password can write)."""


def bucket_digest(flat: torch.Tensor) -> str:
    """64-bit BLAKE3 of a packed bucket's bytes, in hex.

    BLAKE3 hashes about 4 GB/s on one CPU core (bench: ``bench/weight_sync.py``), so a bucket costs little beside
    its transfer; a CUDA bucket is copied to the host first.
    """
    host = flat.detach().contiguous().cpu()
    return blake3.blake3(host.view(torch.uint8).numpy().data).hexdigest(DIGEST_BYTES)


def version_digest(bucket_digests: Sequence[str]) -> str:
    """The digest of one version: BLAKE3 over its bucket digests in order (what heartbeats and the audit name)."""
    return blake3.blake3(",".join(bucket_digests).encode()).hexdigest(DIGEST_BYTES)


def seal_buckets(buckets: Sequence[WeightBucket], flats: Sequence[torch.Tensor]) -> tuple[list[WeightBucket], str]:
    """``buckets`` with the digest of each packed bucket in ``flats`` filled in, and the version digest."""
    sealed = [dataclasses.replace(b, digest=bucket_digest(f)) for b, f in zip(buckets, flats, strict=True)]
    return sealed, version_digest([b.digest for b in sealed])


@dataclass(frozen=True)
class SealedWeights:
    """One version packed for sending: bucket layouts with their digests, the packed buckets, the version digest."""

    buckets: list[WeightBucket]
    flats: list[torch.Tensor]
    digest: str


def pack_sealed(params: Mapping[str, torch.Tensor], bucket_bytes: int, device: str = "cpu") -> SealedWeights:
    """Plan, pack and seal ``params``: what a manifest lists and :meth:`WeightGroup.send_packed` sends."""
    planned = plan_buckets(params, bucket_bytes)
    flats = [pack_bucket(bucket, params, device) for bucket in planned]
    buckets, digest = seal_buckets(planned, flats)
    return SealedWeights(buckets, flats, digest)


def digest_mismatch(buckets: Sequence[WeightBucket], flats: Sequence[torch.Tensor]) -> str:
    """Why the received ``flats`` do not match their manifest's digests, or ``""`` when every bucket matches.

    A bucket without a digest is refused too: an unsealed manifest cannot be told from a forged one.
    """
    for i, (bucket, flat) in enumerate(zip(buckets, flats, strict=True)):
        got = bucket_digest(flat)
        if got != bucket.digest:
            tensors = len(bucket.names)
            return f"bucket {i} ({bucket.dtype}, {tensors} tensors): digest {got} != manifest {bucket.digest!r}"
    return ""


def unpack_bucket(bucket: WeightBucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every parameter of a received bucket; the views share ``flat``'s memory."""
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets, strict=True):
        yield name, flat[offset : offset + math.prod(shape)].view(shape)


def group_backend() -> str:
    """The weight group's backend on this machine: NCCL where CUDA is, gloo on CPUs. The learner and every actor's
    workers decide it alike, so one formation never mixes the two."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def gloo_group(store, rank: int, world_size: int, timeout: timedelta, environ: Mapping[str, str] | None = None):
    """A ``ProcessGroupGloo`` whose sockets are bound to ``$ASYNCRL_ADVERTISE_HOST``'s address when that is set.

    Each rank binds its listening socket on its device and writes that address into the store for its peers. Left to
    itself, gloo takes the interfaces ``GLOO_SOCKET_IFNAME`` names, else resolves this machine's host name (falling
    back to loopback), so hosts whose name resolves to 127.0.0.1 or 127.0.1.1 (Debian's /etc/hosts, containers,
    network namespaces sharing one name) all advertised loopback and every peer connected to its own (measured with
    two network namespaces: ``Connection refused, remote=[127.0.0.1]``, and no actor ever got weights). Bound to the
    advertised address, the one heartbeats carry, a rank is reached where others reach its host
    (``tests/e2e/test_multi_host.py``). ``GLOO_SOCKET_IFNAME``, when set, still wins.
    """
    environ = os.environ if environ is None else environ
    host = environ.get(ADVERTISE_HOST_ENV)
    if not host or environ.get("GLOO_SOCKET_IFNAME"):
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    # torch's stubs declare ProcessGroupGloo.Options; the options its constructor takes are the binding's _Options.
    options = torch.distributed.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
    options._timeout = timeout
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=host)]
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, options)


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

    def __init__(self, address: GroupAddress, store: Store | None = None) -> None:
        self.address = address
        timeout = timedelta(seconds=address.timeout_s)
        self._own_store = store is None
        if store is None:
            given_up = formation_key(address.epoch, ABANDONED)
            store = RedisStore.connect(address.redis_url, address.run, address.timeout_s, abandoned_key=given_up)
        self._store = store  # keep the connection alive as long as the group
        self.store = PrefixStore(formation_key(address.epoch), store)
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
            return gloo_group(store, a.rank, a.world_size, timeout)
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
            if self.group is None:
                raise WeightSyncError("the weight group is closed")
            # torch's stubs leave the collectives out of the Backend classes (ProcessGroupGloo, ProcessGroupNCCL).
            return self.group.broadcast([tensor], options)  # pyright: ignore[reportAttributeAccessIssue]
        except Exception as exc:
            raise WeightSyncError(f"broadcast failed in epoch {self.address.epoch}: {exc}") from exc

    def _wait(self, work, tensor: torch.Tensor, what: str = "broadcast") -> torch.Tensor:
        try:
            if not work.wait(timedelta(seconds=self.address.timeout_s)):
                raise WeightSyncError(f"{what} timed out after {self.address.timeout_s}s")
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"{what} failed in epoch {self.address.epoch}: {exc}") from exc
        return tensor

    def receipt(self) -> None:
        """Every rank says it holds every bucket: a one-element all-reduce after the broadcasts, complete only once
        each member has posted it, which a member does after its last bucket arrived. A broadcast is pipelined through
        the members, so the root's sends can finish while a member further on lost its data (a peer that left
        mid-transfer closed the connection it was fed through); that member never posts the receipt, and the root's
        fails instead of the version being announced to an actor that never got it."""
        flag = torch.ones(1, device=self.device)
        try:
            options = torch.distributed.AllreduceOptions()
            options.reduceOp = torch.distributed.ReduceOp(torch.distributed.ReduceOp.MIN)
            options.timeout = timedelta(seconds=self.address.timeout_s)
            if self.group is None:
                raise WeightSyncError("the weight group is closed")
            work = self.group.allreduce([flag], options)  # pyright: ignore[reportAttributeAccessIssue]
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"receipt failed in epoch {self.address.epoch}: {exc}") from exc
        self._wait(work, flag, "receipt")

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
        """Root: broadcast buckets already packed by :func:`pack_bucket` (at most two in flight), then wait for every
        member's :meth:`receipt`; returns bytes."""
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
        self.receipt()
        return sent

    def receive_all(self, buckets: Sequence[WeightBucket]) -> list[torch.Tensor]:
        """Member: every bucket, received whole before any is used (all receives are posted, then awaited), then its
        :meth:`receipt`."""
        flats = [torch.empty(b.numel, dtype=torch_dtype(b.dtype), device=self.device) for b in buckets]
        works = [self._start(flat) for flat in flats]
        received = [self._wait(work, flat) for work, flat in zip(works, flats, strict=True)]
        self.receipt()
        return received


def absent_ranks(store: Store, epoch: int, world_size: int) -> list[int]:
    """Ranks (1..world-1) that never announced themselves for ``epoch``: the ones to evict after a timeout."""
    prefixed = PrefixStore(formation_key(epoch), store)
    return [rank for rank in range(1, world_size) if not prefixed.check([f"joined/{rank}"])]


ABANDONED = "abandoned"
"""The key, in a formation's store, that says the learner gave up on it."""


def formation_key(epoch: int, key: str = "") -> str:
    """``key`` in formation ``epoch``'s part of the rendezvous store (its prefix when ``key`` is empty)."""
    return f"asyncrl/{epoch}/{key}"


def abandon_formation(store: Store, epoch: int) -> None:
    """The learner's side: mark formation ``epoch`` given up, so that members still waiting in its rendezvous
    (:class:`WeightGroup` with a store of its own) stop at once and come to the next formation."""
    store.set(formation_key(epoch, ABANDONED), "1")
