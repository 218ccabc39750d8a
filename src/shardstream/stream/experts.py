"""MoE experts read on demand and multiplied from the bytes they were read into.

A Mixtral-style block is mostly experts, and a token uses `top_k` of them. With `experts="on_demand"`
the block's part is read without its experts (stored apart by `shardstream shard --experts`), and the
fused experts module's forward is replaced: each expert the router picked is read from its tier
(checksum-verified) into a reused buffer, and the tokens routed to it go through its gate, up and down
products straight from those bytes (bf16/fp16 as stored, 4-bit/8-bit from their codes: the products of
linear.py), weighted and added in expert order as transformers' own forward adds them. No module and no
stacked copy is made of an expert, so a pass costs its experts' reads and their products.

Experts stay in memory between passes, within `budget` bytes, by how often and how lately they were
routed to (expert_cache.py); a pass reads only the routed experts not held, the next one read on a thread
while one multiplies (large ones one after the other, in the order they multiply: `_executor`). As a block's
part is (loader.py), an expert is checked against its checksum the first time it is read in this process,
hashed as its bytes land (store/checksum.py's HashAsRead), so that a corrupt store fails on the first pass
that routes to it; its later reads are checked by their length only: hashing every read takes a core's time
beside the read and slows it. A Mixtral-8x7B block (2.8 GB of experts in bf16) runs in the memory of one
expert read and, with `read_ahead`, the next.

Reads also start ahead of the router (`guessing`, `_Guesses`): once a block's own reads have landed (so that
no guess slows them) and one of its experts has multiplied, the experts the next block will likely pick are
read into the reads' room (all of it but one read's, so that a pass can always read the expert it multiplies
next; less the reads landed and not yet multiplied, topped up as they multiply): those its router
picks for the hidden state as it will enter it, as far as it is known then: this block's residual stream
plus the outputs of the experts it has multiplied so far plus the next block's attention output for the token
before, through the next block's norm (`_Entering`), and for the first block, those it picked for the token
before. A guess's bytes are read but
not checked. When the next block routes, a right guess is its read, already in flight or done, checked on a
reading thread; a wrong one is stopped within one request (direct_io.STOP_PIECE) and its buffer goes back, having cost
its bytes and no CPU. Guesses use only the room the reads already have, so the memory is the same.
"""

from __future__ import annotations

import functools
import logging
import mmap
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from .. import quant
from ..errors import InvalidOption, UnsupportedModel
from ..naming import Part
from ..quant import QuantizedTensor
from ..store import Store
from ..store.checksum import HashAsRead
from ..store.direct_io import ReadStopped, Stoppable, aligned
from ..store.dtypes import TORCH_DTYPES
from ..store.sharding import Expert, load_expert, load_index
from . import half_linear, int4_linear, quant_linear
from .direct import BufferPool
from .expert_cache import ExpertCache
from .linear import weight_linear
from .loader import BlockLoader
from .weights import WeightMapper

log = logging.getLogger("shardstream.stream")

GATE, UP, DOWN = "gate", "up", "down"
# An expert's weight keeps half its score after this many passes of its block without a routing to it
# (expert_cache.py; docs/BENCHMARKS.md, "Stream: MoE under a cap", compares it with LRU).
HALF_LIFE = 16
# Bytes of small experts read ahead while one multiplies, and at most this many of them.
READ_AHEAD_BYTES = 64 << 20
MAX_DEPTH = 8
# Rows of 16-bit activations (a decode step's) whose expert products go through the half-precision kernel.
KERNEL_ROWS = 2
# Below this share of the recent guesses right, a block reads ahead only its likeliest expert, once every
# PROBE_EVERY passes (so that the share is still measured): a guess takes the disk's time and the reading
# threads' (and with them the interpreter's), and pays only when right.
GUESS_PRECISION = 0.25
GUESS_MEMORY = 64   # guesses that share is taken over, each older one weighing less
PROBE_EVERY = 8


def reading_bytes(expert_bytes: int, ahead: bool) -> int:
    """Memory the reading of experts of `expert_bytes` each takes beside the experts held: the one being
    multiplied, and those read `ahead` (the pipeline planner reserves it for a stage, pipeline/costs.py)."""
    return (1 + reading_depth(expert_bytes, ahead)) * expert_bytes


def reading_depth(expert_bytes: int, ahead: bool) -> int:
    """Experts read ahead while one multiplies: one, or as many small ones as READ_AHEAD_BYTES holds (a small
    expert's read is short, and one at a time leaves the disk waiting between them)."""
    return 0 if not ahead else max(1, min(MAX_DEPTH, READ_AHEAD_BYTES // max(expert_bytes, 1)))


@dataclass(frozen=True)
class ExpertSource:
    """Where experts='on_demand' reads a model's experts from: a store whose experts `shard --experts` placed,
    and which of each block's experts the model's modules hold (`numbers`, the first of them held as 0: a
    tensor-parallel rank's share, tp/experts.py); None: all of them."""

    store: Store
    numbers: range | None = None


def on_demand_advice(store: Store) -> str:
    """What to tell whoever loads `store`'s experts with their blocks into too little memory ("" for a store
    without experts): read them on demand, after placing them apart where `shard --experts` has not."""
    how = "`experts='on_demand'`, `--experts on-demand`"
    if load_index(store).experts:
        return f"read its experts on demand, one at a time ({how}), "
    if any(record.expert is not None for record in store.manifest.tensors.values()):
        return (f"place its experts apart (`shardstream shard {store.root} --experts`) and read them on demand "
                f"({how}), ")
    return ""


def served_experts(source: ExpertSource, layers: range | None = None) -> list:
    """The placed experts (sharding index records) that experts='on_demand' serves from `source` for these
    blocks (default all); InvalidOption, before anything is read or written, where one is not placed or the
    model has none."""
    store, numbers = source.store, source.numbers
    placed = {key: r for key, r in load_index(store).experts.items() if numbers is None or r.expert in numbers}
    for record in store.manifest.tensors.values():
        if record.expert is None or not (numbers is None or record.expert in numbers):
            continue
        layer = Part.parse(record.part).index
        if (layers is None or layer in layers) and f"{layer}:{record.expert}" not in placed:
            raise InvalidOption(
                f"experts='on_demand' needs every expert placed on a tier, but {store.root} has no placed "
                f"expert {layer}:{record.expert}; run `shardstream shard {store.root} --experts` first."
            )
    served = [r for r in placed.values() if layers is None or r.group in layers]
    if not served:
        raise InvalidOption(f"experts='on_demand' needs a mixture-of-experts model; the store at {store.root} has none.")
    return served


class ExpertlessLoader(BlockLoader):
    """A BlockLoader whose parts come without the expert tensors (those are loaded on demand).

    Experts still inside a part (a `shard --experts` run that was killed before it rewrote the
    part) are dropped after the read."""

    def __init__(self, store: Store, mapper: WeightMapper, device: torch.device, verify: bool, skip: set[str],
                 blocks: range | None = None):
        super().__init__(store, mapper, device, verify, experts=False, blocks=blocks)
        self._skip = skip

    def read(self, parts: list[str], resident: bool = False, keep: frozenset[str] | None = None,
             tied: bool = True, mappings: list | None = None) -> dict[str, torch.Tensor]:
        return {n: t for n, t in super().read(parts, resident, keep, tied, mappings).items() if n not in self._skip}

    def checkpoint_keys(self, index: int) -> list[str]:
        return [n for n in super().checkpoint_keys(index) if n not in self._skip]


@dataclass
class _Filled:
    """An expert's bytes read into `buffer` (`done` of them), their checksum being made (`hashing`; None: a
    read checked by its length only), not checked yet."""
    expert: Expert
    buffer: mmap.mmap
    done: int
    hashing: HashAsRead | None


@dataclass
class _Loaded:
    """One expert ready to multiply: its gate, up and down weights (viewing `buffer` where the products read
    the stored bytes), and the bytes it holds."""
    weights: dict[str, torch.Tensor | QuantizedTensor]
    buffer: mmap.mmap | bytearray | None
    nbytes: int
    read_bytes: int   # what its read fetched


class _Block:
    """One block's fused experts module (gate_up_proj and down_proj stacked over its experts, as transformers
    builds Mixtral, Qwen2-MoE, Qwen3-MoE ...), and which of its checkpoint tensors is an expert's gate, up
    or down weight."""

    def __init__(self, module: nn.Module, prefix: str, keys: set[str], mapper: WeightMapper, root: str):
        params = dict(module.named_parameters(recurse=False))
        if set(params) != {"gate_up_proj", "down_proj"} or getattr(module, "is_transposed", False) \
                or getattr(module, "has_bias", False) or not hasattr(module, "act_fn"):
            raise UnsupportedModel(
                f"the experts module {prefix} ({type(module).__name__}) is not the gate/up/down form that "
                f"experts='on_demand' multiplies from stored bytes; use experts='with_block' for {root}.")
        self.module, self.prefix, self.act = module, prefix, module.act_fn
        self.count = params["gate_up_proj"].shape[0]
        self.dtype = params["gate_up_proj"].dtype
        self.roles: dict[str, str] = {}
        for key in keys:
            fused = mapper.fused_source(key)
            name, place = fused if fused else (key, 0)
            role = {("gate_up_proj", 0): GATE, ("gate_up_proj", 1): UP, ("down_proj", 0): DOWN}.get(
                (name.rpartition(".")[2], place))
            if role is None:
                raise UnsupportedModel(f"{root}: expert tensor {key} is neither the gate, up nor down weight of "
                                       f"{prefix}; use experts='with_block'.")
            self.roles[key] = role


class OnDemandExperts:
    """Serves each MoE block's experts module from the experts routed to in this pass, read on demand and
    multiplied from their stored bytes; those worth keeping stay in an `ExpertCache` of `budget` bytes.

    `loads` counts experts read for routings and `bytes_read` their bytes; `cache.stats` the routings served
    from memory and those that read; `guesses` the reads made ahead of the router (right ones are loads too).
    """

    def __init__(self, source: ExpertSource, model: nn.Module, mapper: WeightMapper, device: torch.device,
                 layers: range | None = None, verify: bool = True):
        """`layers`: the blocks whose experts to serve (a pipeline stage's), default all; `verify`: check each
        expert against its checksum the first time it is read (else by its length only)."""
        store = self.store = source.store
        numbers = source.numbers
        self._first = numbers.start if numbers else 0
        self._device = device
        self.loads = 0
        self.bytes_read = 0
        self.read_ahead = True   # the next expert's file read while one multiplies (fit)
        self.guessing = True   # experts read ahead of the router (_Guesses); off with prefetching=False
        self.drop_pages = False   # set when the experts do not all fit in memory
        self._buffers = BufferPool()   # experts are read into these
        self._verify = verify
        self._verified: set[str] = set()   # keys of the experts whose checksum a read here has passed
        self._threads: tuple[int, ThreadPoolExecutor] | None = None   # (threads, the reading threads)
        self.cache: ExpertCache[_Loaded] = ExpertCache(2 ** 62, HALF_LIFE, self._free)
        self.guesses = _Guesses(self._fill, self._checked_when_read, self._give)
        self._routers: dict[int, torch.Tensor] = {}   # each block's router weight, kept (float32) at its first run
        self._entering = _Entering()   # what the next block's router will see, as far as known (guesses)
        # the first block's router picks of its last pass and their weights (top_k_index, top_k_weights)
        self._first_picks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hooks = []
        mine = served_experts(source, layers)
        by_layer: dict[int, set[str]] = {}
        for record in mine:
            by_layer.setdefault(record.group, set()).update(record.tensors)
        self.checkpoint_names = set().union(*by_layer.values())
        self._file_bytes = max(r.length for r in mine)   # the largest expert's bytes: one read's buffer
        self._blocks: dict[int, _Block] = {}
        for layer, names in by_layer.items():
            modules = {target.rpartition(".")[0] for target in mapper.target_names(sorted(names))}
            if len(modules) != 1:
                raise UnsupportedModel(
                    f"the experts of part mid/{layer} in {store.root} map onto {sorted(modules)}, not one fused "
                    f"experts module of {type(model).__name__}; use experts='with_block'."
                )
            prefix = modules.pop()
            module = model.get_submodule(prefix)
            self._blocks[layer] = _Block(module, prefix, names, mapper, str(store.root))
            module.forward = functools.partial(self._forward, layer)
            router = getattr(model.get_submodule(prefix.rpartition(".")[0]), "gate", None)
            if isinstance(getattr(router, "weight", None), torch.Tensor) and router.weight.dim() == 2:
                self._hooks.append(router.register_forward_pre_hook(functools.partial(self._keep_router, layer)))
            self._hooks += self._entering.watch(layer, model, prefix)
        self.expert_bytes = max(self._held_bytes(r.tensors, self._blocks[r.group].dtype) for r in mine)
        order = sorted(self._blocks)
        self._first_block = order[0]
        self._next = dict(zip(order, order[1:] + order[:1]))   # the block each one guesses for (the last: the first)

    @property
    def module_names(self) -> list[str]:
        """The fused experts modules served here: their weights never fill a block's slots."""
        return [block.prefix for block in self._blocks.values()]

    @property
    def count(self) -> int:
        """Experts served, over all blocks."""
        return sum(block.count for block in self._blocks.values())

    def reading_bytes(self, ahead: bool) -> int:
        """Memory the reading takes beside the experts held (`reading_bytes`), each expert at what it takes held:
        its buffer, and its weights converted where the products cannot read them as stored."""
        return reading_bytes(self.expert_bytes, ahead)

    def depth(self, ahead: bool) -> int:
        """Experts read ahead while one multiplies (`reading_depth`)."""
        return reading_depth(self.expert_bytes, ahead)

    def fit(self, memory: int, auto: bool) -> None:
        """Size the budget of experts held: `memory` bytes of them (not `auto`), reading ahead; or, `auto`,
        out of `memory` left for the experts and their reading, reading ahead only where that leaves room
        for one expert."""
        if not auto:
            self.read_ahead = True
            self.cache.shrink(memory)
            return
        self.read_ahead = memory >= self.reading_bytes(ahead=True) + self.expert_bytes
        self.cache.shrink(max(0, memory - self.reading_bytes(self.read_ahead)))

    def preload(self) -> int:
        """Read every expert into the cache now, where the budget holds them all (a model whose experts fit in
        memory: llama.cpp's mapping reads its whole model at load likewise), so that no pass waits on a read or
        on a guess; each is checked against its checksum as it lands, read past the page cache (the experts
        held are the copy). The experts read (0 where they do not all fit, or come over HTTP: the cache then
        keeps what the routings bring back)."""
        keys = [(layer, expert) for layer, block in self._blocks.items() for expert in range(block.count)]
        if not keys or self.store.remote or len(keys) * self.expert_bytes > self.budget:
            return 0

        def read(key: tuple[int, int]) -> _Loaded:
            return self._checked(key[0], self._fill(*key, None, drop=True))

        for (layer, expert), loaded in zip(keys, self._executor().map(read, keys)):
            if not self.cache.offer(layer, expert, loaded, loaded.nbytes):
                self._free(loaded)
        log.info("experts: all %d read into memory at load, %.2f GB (they fit the experts' budget)", len(keys),
                 self.cache.held_bytes / 1e9)
        return len(keys)

    def report(self) -> dict:
        """What the experts read and what the cache saved so far (serve's /health shows it)."""
        stats, guesses = self.cache.stats, self.guesses
        return {"loads": self.loads, "bytes_read": self.bytes_read, "hits": stats.hits, "misses": stats.misses,
                "hit_rate": round(stats.hit_rate, 4), "held_bytes": self.cache.held_bytes, "budget_bytes": self.budget,
                "guesses": guesses.made, "guessed_right": guesses.right, "guess_wasted_bytes": guesses.wasted_bytes}

    def close(self) -> None:
        """Stop the reads made ahead of the router, end the reading threads, drop the router hooks."""
        self.guesses.settle(None, (), None)
        if self._threads:
            self._threads[1].shutdown()
            self._threads = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @property
    def budget(self) -> int:
        """Bytes of experts held between passes, at most."""
        return self.cache.budget

    def _held_bytes(self, records: dict[str, dict], dtype: torch.dtype) -> int:
        """Bytes one expert takes held: its file's (page-rounded), and its weights converted where the
        products cannot read them as stored."""
        converted = 0
        for record in records.values():
            meta = record.get("quant")
            numel = torch.Size(record["shape"]).numel()
            if meta:
                stays = quant_linear.packable(meta, self._device)
            else:   # on a GPU every plain weight is a copy there
                stays = self._device.type == "cpu" and _read_as_stored(
                    TORCH_DTYPES[record["dtype"]], len(record["shape"]), dtype, self._device)
            converted += 0 if stays else numel * dtype.itemsize
        return (aligned(self._file_bytes) if self._device.type == "cpu" else 0) + converted

    def _forward(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts forward over the experts routed to, each from the cache or read (those not held
        read ahead while one multiplies: `_Reads`; a right guess's read already started). The experts multiply
        in the order their weights are at hand, those held first (those that one token alone routes to, as in a
        decode step: all together, `_multiply_together`), then the right guesses, then the reads in expert
        order, so that none waits behind a read; their outputs are added in expert order (`_InExpertOrder`),
        transformers' sums. Once this block's reads have all landed and an expert has
        multiplied, the next block's likely experts (`_guessed`, ranked once, from the outputs multiplied by then)
        are read into the room that the reads not yet multiplied leave, topped up as they multiply."""
        block = self._blocks[layer]
        self.cache.tick(layer)
        routed = [e for e in top_k_index.unique().tolist() if e < block.count]   # count: "no expert"
        held = {expert: self.cache.get(layer, expert) for expert in routed}
        pinned = frozenset(expert for expert in routed if held[expert] is not None)
        missing = [e for e in routed if held[e] is None]
        threads, slots = self._executor(), 1 + self.depth(self.read_ahead)
        started = self.guesses.settle(layer, missing, threads)
        missing.sort(key=lambda expert: expert not in started)   # stable: the reads under way first
        reads = _Reads(threads, functools.partial(self._load, layer), missing, slots - 1, self._free, started)
        out = _InExpertOrder(torch.zeros_like(hidden_states), routed)
        if layer == self._first_block:
            self._first_picks = (top_k_index, top_k_weights)
        upcoming = self._next[layer]
        # nothing to guess where the next block's experts are all held (a model whose experts fit)
        room = (self.guesses.allowance(slots - 1) if self.guessing and not self.store.remote
                and self.cache.held_in(upcoming) < self._blocks[upcoming].count else 0)
        mid = self._entering.residual(layer)
        # the next block and its likely experts, ranked once, from the outputs multiplied by then
        ahead = functools.cache(lambda: self._guessed(layer, hidden_states, mid, out, top_k_index.shape[-1]))

        def guess() -> None:
            """Read ahead for the next block into the room this pass's reads not yet multiplied leave."""
            if room and ahead() and room > reads.in_flight:
                self.guesses.start(threads, *ahead(), room - reads.in_flight)

        together = _multiply_together(block, {e: held[e].weights for e in routed if e in pinned}, hidden_states,
                                      top_k_index, top_k_weights, out)
        order = [*(e for e in routed if e in pinned and e not in together), *missing]
        try:
            for number, expert in enumerate(order, len(together)):
                loaded = held[expert]
                if loaded is None:
                    loaded = reads.take()
                    self.loads += 1
                    self.bytes_read += loaded.read_bytes
                if number and reads.landed:   # the disk is the guesses' once this block's reads landed
                    guess()
                _multiply(block, loaded.weights, expert, hidden_states, top_k_index, top_k_weights, out)
                # experts held for this pass stay until it ends: their buffers are still to be multiplied from
                if held[expert] is None and not self.cache.offer(layer, expert, loaded, loaded.nbytes, pinned):
                    self._free(loaded)
            guess()
        finally:
            reads.close()
        return out.total

    def _guessed(self, layer: int, hidden_states: torch.Tensor, mid: torch.Tensor | None, out: _InExpertOrder,
                 top_k: int) -> tuple[int, list[int]] | None:
        """The block to read ahead for after `layer`, and its experts not held, the likeliest first (`_ranked`):
        those the next block's router picks (its `top_k` a token) for the hidden state that will enter it, as far
        as known (`_Entering.state`: the residual stream `mid` plus the experts' outputs in `out` so far; without
        them, this block's `hidden_states`); after the last block, the first one's picks of its last pass. None
        when nothing can be guessed."""
        upcoming = self._next[layer]
        if upcoming > layer:
            weight = self._routers.get(upcoming)
            if weight is None:
                return None
            state = self._entering.state(upcoming, mid, out.so_far())
            state = hidden_states.float() if state is None else state
            weights, picks = torch.topk(functional.linear(state, weight).softmax(-1), top_k, dim=-1)
            likely = _ranked(picks - self._first, weights, self._blocks[upcoming].count)
        else:
            picked = self._first_picks
            likely = [] if picked is None else _ranked(*picked, self._blocks[upcoming].count)
        likely = [expert for expert in likely if not self.cache.holds(upcoming, expert)]
        return (upcoming, likely) if likely else None

    def _keep_router(self, layer: int, module: nn.Module, args) -> None:
        """Keep block `layer`'s router weight when it first runs (filled then, whether resident or streamed): the
        block before it guesses from it."""
        if layer not in self._routers and module.weight.device.type != "meta":
            self._routers[layer] = module.weight.detach().float().clone()

    def _executor(self) -> ThreadPoolExecutor:
        """The reading threads, shared by the passes and the guesses: two when small experts are read ahead, so
        that the disk has more than one request to serve; one for experts of READ_AHEAD_BYTES or more, whose
        one request keeps the disk busy: they are read one after the other, in the order they are multiplied,
        so that each is multiplied while the next reads (two side by side would share the disk and land
        together)."""
        threads = 2 if self.read_ahead and self._file_bytes < READ_AHEAD_BYTES else 1
        if self._threads is None or self._threads[0] != threads:
            if self._threads:
                self._threads[1].shutdown()
            self._threads = (threads, ThreadPoolExecutor(threads, thread_name_prefix="experts"))
        return self._threads[1]

    def _load(self, layer: int, expert: int) -> _Loaded:
        """One expert's weights, read and checked: into a reused buffer from a local file (`_fill`), or over
        HTTP, then placed for the products."""
        if self.store.remote:
            placed = load_expert(self.store, layer, self._first + expert)
            verify = self._verifies(placed)
            tensors = placed.read(verify=verify, dequantize=False)
            if verify:
                self._verified.add(placed.record.key)
            return self._loaded(layer, tensors, None, placed.nbytes)
        return self._checked(layer, self._fill(layer, expert, None))

    def _verifies(self, placed: Expert) -> bool:
        """Whether this read of `placed` is checked against its checksum: its first in this process."""
        return self._verify and placed.record.key not in self._verified

    def _fill(self, layer: int, expert: int, stop: Stoppable | None, drop: bool | None = None) -> _Filled:
        """An expert's bytes read into a reused buffer (past the page cache when `drop`, by default
        `drop_pages`; `stop`: a guess's read: Expert.fill), not checked yet: a guess is checked only once its
        block routes to it."""
        placed = load_expert(self.store, layer, self._first + expert)
        buffer = self._buffers.take(self._file_bytes)
        try:
            return _Filled(placed, buffer, *placed.fill(buffer, drop=self.drop_pages if drop is None else drop,
                                                        stop=stop, verify=self._verifies(placed)))
        except BaseException:
            self._give(buffer)
            raise

    def _checked(self, layer: int, filled: _Filled) -> _Loaded:
        """The expert `filled` read, checked against its checksum and placed for the products."""
        try:
            tensors = filled.expert.tensors_in(filled.buffer, filled.done, filled.hashing, dequantize=False)
        except BaseException:
            self._give(filled.buffer)
            raise
        if filled.hashing is not None:
            self._verified.add(filled.expert.record.key)
        return self._loaded(layer, tensors, filled.buffer, filled.expert.nbytes)

    def _checked_when_read(self, layer: int, read: Future) -> _Loaded:
        """`_checked` once the guess's `read` is done (a reading thread runs it: the checksum is not the pass's
        to wait for)."""
        return self._checked(layer, read.result())

    def _loaded(self, layer: int, tensors: dict, buffer: mmap.mmap | None, read_bytes: int) -> _Loaded:
        """An expert's stored tensors placed for the products (`_placed`); its buffer given back when nothing
        views it."""
        block = self._blocks[layer]
        weights = {block.roles[name]: self._placed(tensor, block.dtype) for name, tensor in tensors.items()}
        parts = [part for weight in weights.values() for part in quant.held_by(weight)]
        start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() if buffer is not None else 0
        apart = [part for part in parts if not (buffer is not None and start <= part.data_ptr() < start + len(buffer))]
        if buffer is not None and len(apart) == len(parts):   # nothing views the buffer: it can be read into again
            self._give(buffer)
            buffer = None
        return _Loaded(weights, buffer, (len(buffer) if buffer is not None else 0) + sum(p.nbytes for p in apart),
                       read_bytes)

    def _placed(self, tensor: torch.Tensor | QuantizedTensor, dtype: torch.dtype) -> torch.Tensor | QuantizedTensor:
        """A stored weight as the products take it on this device: as stored where they read it so (codes a
        kernel multiplies, half precision beside float32 activations on the CPU, the model's own dtype),
        else converted into the model's dtype."""
        device = self._device
        if isinstance(tensor, QuantizedTensor):
            if quant_linear.packable(tensor.meta, device):
                return tensor if device.type == "cpu" else QuantizedTensor(
                    tensor.data.to(device), tensor.absmax.to(device), tensor.meta)
            tensor = quant.dequantize(tensor.data.to(device), tensor.absmax.to(device), tensor.meta)
        if not _read_as_stored(tensor.dtype, tensor.dim(), dtype, device):
            return tensor.to(device=device, dtype=dtype)
        return tensor.to(device)

    def _free(self, loaded: _Loaded) -> None:
        self._give(loaded.buffer)
        loaded.weights.clear()

    def _give(self, buffer: mmap.mmap | bytearray | None) -> None:
        if isinstance(buffer, mmap.mmap):
            self._buffers.give([buffer])


class _Reads:
    """The experts of a pass that are not held, read in order on the reading threads: the first at once, and
    `depth` more while one multiplies (0: each next one once the one before is done with). `started`: reads
    of some of them begun ahead of the router (right guesses), in flight already and counted so."""

    def __init__(self, threads: ThreadPoolExecutor, load: Callable[[int], _Loaded], experts: list[int], depth: int,
                 free: Callable[[_Loaded], None], started: dict[int, Future]):
        self._threads, self._load, self._todo, self._depth, self._free = threads, load, deque(experts), depth, free
        self._started = started
        self._pending: deque[Future] = deque()
        self._top_up(1 + depth)

    @property
    def in_flight(self) -> int:
        """Reads begun and not yet taken."""
        return len(self._pending) + len(self._started)

    @property
    def landed(self) -> bool:
        """Whether every read has been begun and has landed (taken or not)."""
        return not self._todo and all(read.done() for read in (*self._pending, *self._started.values()))

    def _top_up(self, in_flight: int) -> None:
        while self._todo and (self._todo[0] in self._started or self.in_flight < in_flight):
            expert = self._todo.popleft()
            started = self._started.pop(expert, None)
            self._pending.append(started if started is not None else self._threads.submit(self._load, expert))

    def take(self) -> _Loaded:
        # the next expert's read, beside the guesses begun (they leave room for one read: _Guesses)
        self._top_up(self.in_flight + 1 if not self._pending else 1)
        loaded = self._pending.popleft().result()
        self._top_up(self._depth)
        return loaded

    def close(self) -> None:
        """Wait for reads still in flight (a pass that failed) and free what they read."""
        for pending in [*self._pending, *self._started.values()]:
            try:
                self._free(pending.result())
            except BaseException:
                pass   # the pass's own error is the one to report
        self._pending.clear()
        self._started.clear()


class _Guesses:
    """Experts read ahead of their block's router, in the room the reads leave (module docstring), for one
    block at a time: `start` reads the likeliest (`fill`: bytes only, unchecked), `settle` hands that block's
    pass the right ones' reads (`check`ed on a reading thread once read) and stops, waits for and gives back
    (`give`) the others' buffers. `made` guesses, `right` of them routed to, `wasted_bytes` read for the
    others."""

    def __init__(self, fill: Callable[[int, int, Stoppable], _Filled], check: Callable[[int, Future], _Loaded],
                 give: Callable[[mmap.mmap], None]):
        self._fill, self._check, self._give = fill, check, give
        self._layer: int | None = None
        self._reads: dict[int, tuple[Future, Stoppable]] = {}
        self.made = self.right = self.wasted_bytes = 0
        self._recent = (0.0, 0.0)   # guesses right and made lately, decayed (GUESS_MEMORY)
        self._quiet = 0   # passes while guesses were seldom right

    @property
    def precision(self) -> float:
        """The share of the recent guesses that were right (1 before any)."""
        right, made = self._recent
        return (right + 1) / (made + 1)

    def allowance(self, room: int) -> int:
        """How many guesses a block's pass may have in flight, out of the reads' `room`: all of it while the
        guesses are right often enough (GUESS_PRECISION), else one every PROBE_EVERY passes."""
        if self.precision >= GUESS_PRECISION:
            return room
        self._quiet += 1
        return min(room, 1) if self._quiet % PROBE_EVERY == 0 else 0

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, threads: ThreadPoolExecutor, layer: int, likely: list[int], room: int) -> None:
        """Read `layer`'s experts `likely` (the likeliest first) not read yet, until `room` guesses are in
        flight."""
        if self._reads and self._layer != layer:
            self.settle(None, (), None)
        self._layer = layer
        for expert in likely:
            if len(self._reads) >= room:
                break
            if expert not in self._reads:
                stop = Stoppable()
                self._reads[expert] = (threads.submit(self._fill, layer, expert, stop), stop)
                self.made += 1

    def settle(self, layer: int | None, needed: list[int] | tuple, threads: ThreadPoolExecutor | None) -> dict[int, Future]:
        """The experts of `layer` in `needed` whose reads began ahead (right guesses), each the future of its
        checked weights (checked on `threads` once read; the read goes on in whole requests); every other
        guess stopped and its buffer given back before this returns, so that its room is free for the reads to
        come. A reading thread takes a check only once the reads submitted before it are under way, so it
        waits for a read in progress, never for one still queued."""
        right = {}
        for expert, (read, stop) in self._reads.items():
            if layer == self._layer and expert in needed:
                stop.kept = True
                right[expert] = threads.submit(self._check, layer, read)
                continue
            stop.stopped = True
            if read.cancel():
                continue
            try:
                filled = read.result()
            except ReadStopped as stopped:
                self.wasted_bytes += stopped.done
            except Exception:
                pass   # an expert nobody routed to: a read that needs it reports its error
            else:
                self.wasted_bytes += filled.done
                if filled.hashing is not None:
                    filled.hashing.close()
                self._give(filled.buffer)
        if self._reads:
            kept = (1 - 1 / GUESS_MEMORY) ** len(self._reads)
            self._recent = (self._recent[0] * kept + len(right), self._recent[1] * kept + len(self._reads))
        self.right += len(right)
        self._reads.clear()
        self._layer = None
        return right


def _ranked(picks: torch.Tensor, weights: torch.Tensor, count: int) -> list[int]:
    """The experts of a module of `count` among router `picks` (others: not its own), by the routing `weights`
    given them summed over the tokens: a single token's likeliest first, and over many, those most of them
    weigh most (ties: the lower expert first). Summed in Python: a decode step's few picks cost less so than in
    torch's small operations, each a call of its own."""
    tally: dict[int, float] = {}
    for expert, weight in zip(picks.flatten().tolist(), weights.flatten().float().tolist()):
        if 0 <= expert < count:
            tally[expert] = tally.get(expert, 0.0) + weight
    return sorted(tally, key=lambda expert: (-tally[expert], expert))


def _read_as_stored(stored: torch.dtype, dims: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the products take a plain stored weight as it is, no converted copy: in the model's dtype, or a
    16-bit matrix beside float32 activations on the CPU (half_linear.py)."""
    return stored == dtype or (device.type == "cpu" and dtype == torch.float32 and stored in half_linear.FORMATS
                               and dims == 2)


class _Entering:
    """What a block's router will see, as far as it is known while the block before it still runs: that
    block's residual stream (the input of its post-attention norm, kept for the pass: `residual`) plus its
    experts' outputs so far, plus this block's attention output of the pass before (a sequence's last row:
    from one token to the next a block's attention output changes less than it weighs), through this block's
    post-attention norm (an RMS norm, its weight kept at its first run, as the router's: the block may be
    streamed). Blocks without such a norm guess from the block before's own router input."""

    def __init__(self) -> None:
        self._residuals: dict[int, torch.Tensor] = {}
        self._attended: dict[int, torch.Tensor] = {}   # each block's attention output of its last pass, last rows
        self._norms: dict[int, tuple[torch.Tensor, float]] = {}   # float32 weight, epsilon

    def watch(self, layer: int, model: nn.Module, prefix: str) -> list:
        """Hooks on the post-attention norm and the attention of the decoder layer holding the experts module
        `prefix` (none where it has no RMS norm)."""
        decoder = model.get_submodule(prefix.rpartition(".")[0].rpartition(".")[0])
        norm = getattr(decoder, "post_attention_layernorm", None)
        if not isinstance(getattr(norm, "weight", None), torch.Tensor) \
                or not isinstance(getattr(norm, "variance_epsilon", None), float):
            return []
        hooks = [norm.register_forward_pre_hook(functools.partial(self._keep, layer))]
        attention = getattr(decoder, "self_attn", None)
        if isinstance(attention, nn.Module):
            hooks.append(attention.register_forward_hook(functools.partial(self._keep_attended, layer)))
        return hooks

    def _keep(self, layer: int, norm: nn.Module, args) -> None:
        self._residuals[layer] = args[0]
        if layer not in self._norms and norm.weight.device.type != "meta":
            self._norms[layer] = (norm.weight.detach().float().clone(), norm.variance_epsilon)

    def _keep_attended(self, layer: int, attention: nn.Module, args, output) -> None:
        attended = output[0] if isinstance(output, tuple) else output
        if isinstance(attended, torch.Tensor) and attended.dim() == 3:   # batch x sequence x hidden
            # a copy: a view of the last rows would keep a whole prompt's output alive
            self._attended[layer] = attended[:, -1].detach().to(torch.float32, copy=True)

    def residual(self, layer: int) -> torch.Tensor | None:
        """Block `layer`'s residual stream of this pass, let go of (it is the pass's to keep)."""
        return self._residuals.pop(layer, None)

    def state(self, upcoming: int, residual: torch.Tensor | None, outputs: torch.Tensor) -> torch.Tensor | None:
        """Block `upcoming`'s router input as far as known: `residual` plus `outputs`, plus its attention output
        of the pass before where that pass had a row for each of these (a decode step's one token a sequence),
        normed (float32; one row a token); None without the residual or the norm."""
        norm = self._norms.get(upcoming)
        if residual is None or norm is None:
            return None
        weight, epsilon = norm
        state = residual.reshape(outputs.shape).float() + outputs.float()
        attended = self._attended.get(upcoming)
        if attended is not None and attended.shape == state.shape:
            state += attended
        return functional.rms_norm(state, weight.shape, weight, epsilon)


class _InExpertOrder:
    """The experts' outputs summed into `total` in expert order, as transformers sums them (so the same bits),
    whichever order they are multiplied in: an output that comes before a lower expert's waits for it."""

    def __init__(self, total: torch.Tensor, routed: list[int]):
        self.total = total
        self._order = deque(sorted(routed))
        self._waiting: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, expert: int, token_idx: torch.Tensor | int, hidden: torch.Tensor) -> None:
        """The expert's output rows `hidden` for its tokens (a tensor of distinct tokens, or one token's index)."""
        self._waiting[expert] = (token_idx, hidden)
        while self._order and self._order[0] in self._waiting:
            _add_rows(self.total, *self._waiting.pop(self._order.popleft()))

    def so_far(self) -> torch.Tensor:
        """The outputs multiplied so far, those waiting for a lower expert's too."""
        if not self._waiting:
            return self.total
        partial = self.total.clone()
        for token_idx, hidden in self._waiting.values():
            _add_rows(partial, token_idx, hidden)
        return partial


def _add_rows(total: torch.Tensor, tokens: torch.Tensor | int, rows: torch.Tensor) -> None:
    """total[tokens] += rows, as transformers' `index_add_` adds them (the same bits: one addition an element, the
    tokens distinct); one token's row as an in-place add into its view, which costs the CPU a small part of what
    `index_add_` does."""
    if isinstance(tokens, int):
        total[tokens].add_(rows[0].to(total.dtype))   # into the view (`+=` would copy the view onto itself after)
    else:
        total.index_add_(0, tokens, rows.to(total.dtype))


def _multiply(block: _Block, weights: dict[str, torch.Tensor | QuantizedTensor], expert: int,
              hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              out: _InExpertOrder) -> None:
    """transformers' experts forward for one expert, from its weights as held: the tokens routed to it
    through act(gate) * up and down, weighted, added into `out`."""
    top_k_pos, token_idx = torch.where(top_k_index.t() == expert)
    state = hidden_states[token_idx]
    hidden = block.act(_product(state, weights[GATE])) * _product(state, weights[UP])
    out.add(expert, token_idx if len(token_idx) > 1 else int(token_idx[0]),
            _product(hidden, weights[DOWN]) * top_k_weights[token_idx, top_k_pos, None])


def _multiply_together(block: _Block, held: dict[int, dict[str, torch.Tensor | QuantizedTensor]],
                       hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       out: _InExpertOrder) -> set[int]:
    """`_multiply` of the experts at hand (`held`) that one token alone routes to (a decode step's, or each of a
    batch's few), all of them at once: their gates and ups in one kernel call and their downs in another (`rows`:
    one split over the threads for all, not three an expert), the same operations on the same values
    otherwise, so the same bits. Returns the experts multiplied: none where fewer than two qualify or their
    weights are not all int4 or all bfloat16/float16 on the CPU."""
    if len(held) < 2 or hidden_states.device.type != "cpu":
        return set()
    routings: dict[int, list[tuple[int, int]]] = {}   # expert -> (token, place among its top k)
    for token, picks in enumerate(top_k_index.tolist()):
        for place, expert in enumerate(picks):
            if expert in held:
                routings.setdefault(expert, []).append((token, place))
    experts = sorted(e for e, routed in routings.items() if len(routed) == 1)
    if len(experts) < 2:
        return set()
    weights = [held[e] for e in experts]
    kernel = next((k for k in (int4_linear, half_linear)
                   if all(k.rows_fit([w[role] for w in weights]) for role in (GATE, UP, DOWN))), None)
    if kernel is None or (kernel is half_linear and hidden_states.dtype not in (torch.float32, weights[0][GATE].dtype)):
        return set()
    dtype, count = hidden_states.dtype, len(experts)
    tokens, places = zip(*(routings[e][0] for e in experts))
    if len(set(tokens)) == 1:   # a decode step's one token: its row, read by every product (no copies of it)
        states = hidden_states[tokens[0]:tokens[0] + 1].float()
    else:
        states = hidden_states[list(tokens)].float()
        states = torch.cat([states, states])
    gate_up = kernel.rows(states, [w[GATE] for w in weights] + [w[UP] for w in weights]).to(dtype)
    # the activation an expert's row at a time: torch's elementwise kernels take a short tensor's values one by
    # one and a longer one's by vectors, and an exponential's bits differ between the two
    hidden = torch.cat([block.act(gate) for gate in gate_up[:count].split(1)]) * gate_up[count:]
    down = kernel.rows(hidden.float(), [w[DOWN] for w in weights]).to(dtype)
    picked = top_k_weights.tolist()   # the routing weights by value (exact in a Python float): no tensor indexing
    routing = torch.tensor([[picked[token][place]] for token, place in zip(tokens, places)], dtype=top_k_weights.dtype)
    for expert, token, output in zip(experts, tokens, (down * routing).split(1)):
        out.add(expert, token, output)
    return set(experts)


def _product(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """`x @ weight.T` from the weight as held. A decode step's row or two of bf16/fp16 activations go through
    the half-precision kernel too, in float32 math rounded once to their dtype (as torch's own product rounds
    its float32 sums): on an expert's small matrices it reads the stored values faster than torch's 16-bit
    product (docs/BENCHMARKS.md, "Stream: MoE under a cap")."""
    if isinstance(weight, QuantizedTensor):
        return quant_linear.linear(x, weight, None)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= KERNEL_ROWS and x.dtype == weight.dtype and x.device.type == "cpu" and half_linear.available()
            and half_linear.supports(weight, torch.float32)):
        return half_linear.linear(x.float(), weight, None).to(x.dtype)
    return weight_linear(x, weight, None)
