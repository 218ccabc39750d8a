"""The ranks' process group, and the check that every rank opened the same model.

`torchrun` sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and LOCAL_RANK; a program may also initialize
torch.distributed itself. Collectives go over gloo on CPUs and NCCL on GPUs (torch.distributed's own
transports). Each rank opens its own copy of the store (on its own machine), so before any weight is
read the ranks compare a fingerprint of their manifests with one all-gather: a rank started with
another model, another compression or other TP slices would otherwise compute garbage silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InvalidOption, RankMismatch
from ..store.checksum import checksum_bytes
from ..store.manifest import canonical_json
from ..store.reader import Store
from ..store.sharding import load_index

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_started: list[bool] = []   # [True] while a group that join_group initialized is up


def check_torchrun() -> None:
    """Refuse, with what to do, a process that is no rank of a group (not started by torchrun)."""
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if missing and not dist.is_initialized():
        raise InvalidOption(
            f"tensor parallelism runs one process per rank, and {', '.join(missing)} is not set; start it with "
            "`torchrun --nproc-per-node N -m shardstream generate STORE --tensor-parallel ...` (or `serve`) "
            "(or initialize torch.distributed first)."
        )


def join_group(device: str | torch.device, timeout: timedelta | None = None) -> torch.device:
    """Initialize torch.distributed from torchrun's variables unless the program already did; the
    device this rank computes on (cuda:<local rank> when a GPU was asked for without an index).
    `timeout`: how long a collective waits for the other ranks (torch's default when None)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        check_torchrun()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        _started[:] = [True]
    return device


def _attempt_store(timeout: timedelta | None) -> dist.Store:
    """torchrun's store (env://), its keys under this start's own prefix. With static rendezvous
    (`--master-addr/--master-port`) every restart of `--max-restarts` meets the same store, where the
    ranks' addresses of the start before are still found: a new rank 1 could read the dead rank 0's and
    give up on it ("Gloo connectFullMesh failed ... Connection refused") before the new rank 0 wrote its
    own, which used up the restarts."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout or timedelta(minutes=30)))
    return dist.PrefixStore(f"shardstream/start_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def leave_group() -> None:
    """Destroy the group if join_group started it; one the program initialized is the program's."""
    if _started and dist.is_initialized():
        dist.destroy_process_group()
    _started.clear()


def each_machine_once(open_: Callable[[], Store]) -> Store:
    """`open_()` (which may convert a checkpoint into the store) on local rank 0 first, then on the others
    of its machine, so two ranks never convert into the same folder; an error on one rank stops them all."""
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    store, error = None, None
    if first:
        try:
            store = open_()
        except Exception as exc:   # handed to every rank below, then raised here as it was
            error = exc
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"rank {dist.get_rank()}: {error}")
    if error is not None:
        raise error
    failed = next((e for e in errors if e), None)
    if failed:
        raise RankMismatch(f"another rank could not open the store ({failed}); fix that rank's store first.")
    return store if first else open_()


def fingerprint(store: Store) -> str:
    """What two copies of one model share: config, tensors (names, dtypes, shapes, quantization) and
    the checksums of the files they are in; not where the store is nor what it was converted from."""
    manifest = store.manifest
    body = {"config": manifest.config, "compression": manifest.compression,
            "tensors": {n: [r.dtype, r.shape, r.quant] for n, r in manifest.tensors.items()},
            "files": {n: f.xxh3_128 for n, f in manifest.files.items()}, "aliases": manifest.aliases}
    return checksum_bytes(canonical_json(body))


def exported_counts(store: Store) -> list[int]:
    """Rank counts the store holds exported TP slices for (`shardstream shard --tp N`)."""
    if not store.manifest.sharding:
        return []
    return sorted({s.count for s in load_index(store).slices})


def check_same_store(store: Store, size: int) -> bool:
    """Refuse (on every rank) unless all ranks opened the same model with the same slices for `size`
    ranks; whether those exported slices exist (so every rank reads them instead of the whole parts)."""
    mine = (fingerprint(store), size in exported_counts(store), str(store.root))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, (theirs, sliced, root) in enumerate(everyone):
        if theirs != first[0]:
            raise RankMismatch(
                f"rank {rank} opened {root}, another model than rank 0's {first[2]} (manifest fingerprints "
                f"{theirs[:12]} and {first[0][:12]}); start every rank with a copy of the same store."
            )
        if sliced != first[1]:
            has, lacks = (root, first[2]) if sliced else (first[2], root)
            raise RankMismatch(
                f"{has} holds TP slices for {size} ranks but {lacks} does not; run `shardstream shard STORE "
                f"--tp {size}` on every copy of the store, or on none."
            )
    return first[1]
