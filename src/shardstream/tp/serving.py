"""The batch engine over tensor-parallel ranks: rank 0 runs it; the other ranks replay its calls.

Every call of the engine that touches a rank's own state must run on every rank, in the same order,
with the same arguments: each forward pass (its collectives pair up across the ranks) and each KV-cache
operation (`reserved_cache`, `merge`, `select`: the cache of each rank holds only its own KV heads).
On rank 0, `GroupCalls` stands for both the model and the kvcache module of a `BatchEngine`: each call
is broadcast (torch.distributed's broadcast_object_list, tensors on the CPU, caches named by number)
before it runs there; `follow` on the other ranks receives each call and runs it on its own caches.
Everything else (admission, sampling, the HTTP side) happens on rank 0 alone: every rank computes the
same logits, so only rank 0 needs them.

A rank that is idle waits in a collective, which gives up after the group's timeout: while the engine
is idle, rank 0 sends a heartbeat every `heartbeat_s`. A failed call (a rank gone: gloo says the
connection was reset; or timed out) ends the group: `GroupLost` on rank 0 (its `on_lost` is told once)
and on the others, which then exit, so that torchrun can restart the group.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import DynamicCache

from ..errors import GroupLost
from ..serving import kvcache
from ..stream.meta import WrapsModel

CACHE_OPS = ("reserved_cache", "merge", "select")


@dataclass(frozen=True)
class CacheName:
    """A KV cache in a broadcast call: each rank has its own cache of that number."""

    number: int


class GroupCalls(WrapsModel):
    """On rank 0: the model and cache operations a BatchEngine calls (`BatchEngine(calls, cache_ops=calls)`),
    each broadcast to the other ranks before it runs here."""

    def __init__(self, model, heartbeat_s: float, on_lost: Callable[[GroupLost], None]):
        self.model = model
        self.heartbeat_s = heartbeat_s
        self._on_lost = on_lost
        self._lock = threading.Lock()   # one call at a time, in one order, from the engine and the heartbeat
        self._numbers = itertools.count()
        self._dropped: deque[int] = deque()   # caches rank 0 let go of: the others drop theirs with the next call
        self._lost: GroupLost | None = None
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._heart = threading.Thread(target=self._beat, name="shardstream-tp-heartbeat", daemon=True)
        self._heart.start()

    # -- the model, as the engine and the server see it ----------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.model, "dtype", None) or self.model.model.dtype

    @property
    def store(self):
        return self.model.store

    @property
    def experts(self):
        """Rank 0's experts read on demand (None: held with the blocks), which /health reports."""
        return self.model.experts

    def __call__(self, *args, **kwargs):
        return self._run("forward", args, kwargs)

    # -- the cache operations (kvcache's signatures) -------------------------------------------

    def reserved_cache(self, capacity: int) -> DynamicCache:
        cache = kvcache.reserved_cache(capacity)
        number = next(self._numbers)
        cache.shardstream_name = CacheName(number)
        weakref.finalize(cache, self._dropped.append, number)
        self._run("reserved_cache", (capacity,), {}, made=cache.shardstream_name, result=cache)
        return cache

    def merge(self, *args, **kwargs) -> torch.Tensor:
        return self._run("merge", args, kwargs)

    def select(self, *args, **kwargs) -> torch.Tensor:
        return self._run("select", args, kwargs)

    # -- the group -----------------------------------------------------------------------------

    def stop(self) -> None:
        """End the other ranks' `follow` (they leave the group); GroupLost if they are gone."""
        self._stopped.set()
        self._run("stop", (), {})

    def _run(self, op: str, args: tuple, kwargs: dict, made: CacheName | None = None, result=None):
        with self._lock:
            if self._lost is not None:
                raise self._lost
            dropped = []
            while self._dropped:
                dropped.append(self._dropped.popleft())
            try:
                dist.broadcast_object_list([(op, _shared(args), _shared(kwargs), made, dropped)], src=0)
                if op == "forward":
                    result = self.model(*args, **kwargs)
                elif op in ("merge", "select"):
                    result = getattr(kvcache, op)(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any failed call leaves the ranks out of step
                self._lost = GroupLost(f"the tensor-parallel group failed ({error_gist(error)}); this server stops so "
                                       "that torchrun can restart the group; retry once /health answers 200.")
            else:
                self._last = time.monotonic()
                return result
        self._on_lost(self._lost)
        raise self._lost

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last >= self.heartbeat_s / 2:
                try:
                    self._run("beat", (), {})
                except GroupLost:
                    return


def follow(model) -> None:
    """On every rank but 0: run rank 0's calls on this rank's model and caches until it says stop."""
    caches: dict[int, DynamicCache] = {}
    device = model.device
    while True:
        message: list = [None]
        try:
            dist.broadcast_object_list(message, src=0)
            op, args, kwargs, made, dropped = message[0]
            for number in dropped:
                caches.pop(number, None)
            if op == "stop":
                return
            if op == "beat":
                continue
            args, kwargs = _local(args, caches, device), _local(kwargs, caches, device)
            result = model(*args, **kwargs) if op == "forward" else getattr(kvcache, op)(*args, **kwargs)
            if made is not None:
                caches[made.number] = result
            del result   # a forward's logits: every rank has them, rank 0 uses them
        except Exception as error:  # noqa: BLE001 - this rank is out of step with rank 0 from here on
            raise GroupLost(f"rank {dist.get_rank()} lost rank 0 ({error_gist(error)}); it exits so that torchrun "
                            "can restart the group.") from None


def _shared(value):
    """What travels for `value`: a cache by its name, a tensor on the CPU (NCCL ranks put it on their own GPU)."""
    if isinstance(value, DynamicCache):
        return value.shardstream_name
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_shared(v) for v in value)
    if isinstance(value, dict):
        return {k: _shared(v) for k, v in value.items()}
    return value


def _local(value, caches: dict[int, DynamicCache], device: torch.device):
    """The inverse of `_shared` on a following rank: its own cache of that name, tensors on its device."""
    if isinstance(value, CacheName):
        return caches[value.number]
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v, caches, device) for v in value)
    if isinstance(value, dict):
        return {k: _local(v, caches, device) for k, v in value.items()}
    return value


def error_gist(error: BaseException) -> str:
    """The gist of a collective's error: gloo's starts with its source file and ends with advice."""
    text = str(error).strip() or type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".")
