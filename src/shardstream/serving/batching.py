"""Continuous batching over one streaming model: every block read serves every running sequence.

The server, offline batches and benchmarks use this interface (the requests and events: protocol.py):

    engine = BatchEngine(model, eos_token_ids={2}, pad_token_id=0, max_batch_size=32)
    seq = engine.submit(prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.0))
    for event in seq:            # blocks; one TokenEvent per generated token
        ...                      # event.finish_reason is set on the last one
    seq.cancel()                 # from any thread: leaves the batch at the next step
    engine.close()

The KV-cache operations (`reserved_cache`, `merge`, `select`) go through `cache_ops`, the kvcache module
unless told otherwise: tensor-parallel serving replays each of them on every rank (tp/serving.py).

A sequence's greedy tokens equal the tokens it gets alone (`model.generate`, greedy). All running
sequences are rows of one left-padded batch with one transformers DynamicCache; newcomers are
prefilled together in chunks between decode steps, then their cache rows are merged in (why: the
"Continuous batching" part of docs/ARCHITECTURE.md; how: docs/STREAMING.md)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from ..errors import InsufficientMemory, InvalidOption, ShardstreamError
from ..sizes import parse_size
from . import kvcache, pass_memory
from .protocol import (NO_TOKEN, SamplingParams, Sequence, TokenEvent, cancel_all, choose_token, open_sequence,
                       prompt_scores)
from .admission import Shape, kv_peak, map_large_allocations, prefill_passes, room
from .text import check_context

log = logging.getLogger("shardstream.batching")

GATHER_ROUNDS = 10     # an idle engine waits at most this many gather_seconds for a burst of requests to end
KV_AHEAD_TOKENS = 512  # most tokens to come a sequence's KV cache is reserved for; past them it grows as they come


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """position_ids that follow left padding (as generate() derives them): real tokens count from 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _remaining(sequence: Sequence) -> int:
    """Tokens a sequence may still generate."""
    return sequence.params.max_new_tokens - len(sequence.generated)


def _ahead(sequence: Sequence) -> int:
    """Columns the batch's cache reserves for a sequence's tokens to come: all of them up to KV_AHEAD_TOKENS.
    A request without max_tokens may ask for a whole context (32,768 tokens of Qwen2.5-0.5B are 768 MiB of
    float32 cache), and reserving that at once can exhaust the memory; past these the cache grows as
    the tokens come (`BatchEngine._grow`), while memory allows."""
    return min(_remaining(sequence), KV_AHEAD_TOKENS)


def resolve_kv_budget(budget: int | str | None) -> int | None:
    """A fixed bound on the running batch's KV bytes, or None: 'auto' leaves the bound to the memory left
    (checked at every admission, see admission.py), None sets no bound at all."""
    if budget is None or budget == "auto":
        return None
    value = parse_size(budget, "kv_cache_budget") if isinstance(budget, str) else budget
    if value <= 0:
        raise InvalidOption(f"kv_cache_budget must be positive, 'auto' or None, not {budget!r}.")
    return value


@dataclass
class _Prefill:
    """Newcomers being prefilled together, a chunk of columns per pass, before they join the batch."""

    sequences: list[Sequence]
    ids: torch.Tensor            # (rows, longest prompt), left-padded
    mask: torch.Tensor
    chunk_tokens: int            # prompt tokens per pass over all rows (see BatchEngine._admit)
    ahead: int = KV_AHEAD_TOKENS  # fewer for one sequence alone whose tokens ahead the memory left cannot hold
    cache: DynamicCache | None = None   # reserved for the longest prompt by the first pass (a step, whose
                                        # failure fails the group); widened or merged when the group joins
    done_columns: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)   # kept only when prompt_logprobs is asked


class BatchEngine:
    """A background thread that steps all running sequences together, admitting new ones between steps.

    Each loop turn runs at most two passes over the blocks: one chunk (at most `prefill_chunk_tokens`
    tokens) of the newcomers' prefill, then one decode step for every running sequence. With none
    running there is no decoding for a prefill pass to stall, and a chunk may hold up to
    `idle_prefill_tokens` (each pass is a whole weight read: 32 prompts of 32 tokens take one pass, not
    two) when the memory left holds its temporaries. Counters for
    benchmarks: `forward_passes` (passes over the blocks = weight reads) and `tokens_generated`.
    A context manager: leaving it closes the engine.
    """

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int, max_batch_size: int = 32,
                 kv_cache_budget: int | str | None = "auto", prefill_chunk_tokens: int = 512,
                 idle_prefill_tokens: int = 4096, gather_seconds: float = 0.05, cache_ops=kvcache,
                 memory_left: Callable[[], int] | None = None, on_pass: Callable[[int, int], None] | None = None):
        """`memory_left`: bytes the batch may still take now, asked at every admission and before the cache
        grows, under a memory bound only (kv_cache_budget not None); by default measured on the model's
        device (admission.room). Given, it holds the batch to less than the machine has, or to a known amount.
        `on_pass(rows, columns)`: called on the engine's thread after each pass over the blocks with its
        rows and new columns, to see how the work was batched; what it raises fails that pass's sequences."""
        if max_batch_size < 1:
            raise InvalidOption(f"max_batch_size must be at least 1, not {max_batch_size}.")
        for name, tokens in (("prefill_chunk_tokens", prefill_chunk_tokens), ("idle_prefill_tokens", idle_prefill_tokens)):
            if tokens < 1:
                raise InvalidOption(f"{name} must be at least 1, not {tokens}.")
        if gather_seconds < 0:
            raise InvalidOption(f"gather_seconds must be 0 or more, not {gather_seconds}.")
        self.model = model
        self.cache_ops = cache_ops
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.idle_prefill_tokens = max(idle_prefill_tokens, prefill_chunk_tokens)
        self.gather_seconds = gather_seconds
        self.kv_cache_budget = resolve_kv_budget(kv_cache_budget)
        self.memory_bound = kv_cache_budget is not None   # "auto" or a number: admit only what memory holds
        self.device = torch.device(getattr(model, "device", "cpu"))
        self._memory_left = memory_left or functools.partial(room, self.device)
        self._on_pass = on_pass
        if self.memory_bound:
            map_large_allocations()
        if self.memory_bound and self.device.type == "cpu":
            pass_memory.install()
        dtype = getattr(model, "dtype", None) or model.model.dtype
        self.shape = Shape.of(model.config, dtype)
        self.forward_passes = 0   # before the first, the streamed blocks' buffers are not allocated yet
        self.tokens_generated = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._prefill: _Prefill | None = None
        self._limit: str | None = None
        self._closed = False
        self._aborted: BaseException | None = None
        self._condition = threading.Condition()
        self._warm_up()   # before the thread: a server says it listens only once this is done
        self._thread = threading.Thread(target=self._loop, name="shardstream-batch", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Thread-safe. Raises InvalidOption for an empty prompt or one beyond the model's context."""
        config = self.model.config
        sequence = open_sequence(prompt_ids, params, config.get_text_config().vocab_size, self.device, self._notify)
        check_context(config, len(prompt_ids), params.max_new_tokens)
        with self._condition:
            if self._aborted is not None:
                raise self._aborted
            if self._closed:
                raise InvalidOption("the batch engine is closed; submit to an open one.")
            self._waiting.append(sequence)
            self._condition.notify()
        return sequence

    @property
    def running(self) -> tuple[Sequence, ...]:
        """The sequences of the running batch, in row order (those prefilling have not joined yet)."""
        return tuple(self._running)

    @property
    def batch_width(self) -> int:
        """Columns of the running batch so far, padding included: its longest row's tokens (0 when none run)."""
        mask = self._mask   # once: the engine's thread may drop it meanwhile
        return mask.shape[1] if mask is not None else 0

    @property
    def reserved_bytes(self) -> int:
        """KV-cache bytes the running batch holds reserved, columns to come included."""
        return kvcache.reserved_bytes(self._cache)

    def memory_needs(self, group: list[Sequence], chunk_tokens: int, ahead: int = KV_AHEAD_TOKENS) -> tuple[int, int]:
        """(KV bytes of the running batch with `group` merged in, at its widest; bytes it needs beyond what
        is allocated now, at the worst of three moments: the group's prefill passes (the running batch's
        reservation, the group's own and a prefill pass's activations), the merge (the merged reservation
        built a layer at a time while the old ones are dropped), and the reservation's last token (the
        merged reservation plus a decode pass's activations). What admission compares with `memory_left`.

        The batch is left-padded, so every row is as wide as the widest: the merged width (the running
        width after the group's prefill passes, or the group's longest prompt) plus the most tokens any
        row has ahead (`_ahead`, at most `ahead`); that is what kvcache reserves."""
        shape, running = self.shape, len(self._running)
        longest = max(s.prompt_tokens for s in group)
        passes, columns = prefill_passes(len(group), longest, chunk_tokens)
        running_width = self._mask.shape[1] + passes if running else 0
        width = max(running_width, longest)
        remaining = min(ahead, max(_ahead(s) for s in [*self._running, *group]))
        kv = kv_peak(shape, running + len(group), width, remaining)
        allocated = kvcache.reserved_bytes(self._cache)
        own = kv_peak(shape, len(group), longest, 0)   # the group's cache holds its prompts until it joins
        echo = any(s.params.prompt_logprobs for s in group)
        prefill = allocated + own + shape.pass_bytes(len(group), columns, longest, longest if echo else 1)
        merge = max(kv // shape.layers + allocated + own, kv + (allocated + own) // shape.layers)
        last = kv + shape.pass_bytes(running + len(group), 1, width + remaining, 1)
        return kv, max(prefill, merge, last) - allocated

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, wait_s: float | None = None) -> bool:
        """Finish (cancel) every sequence and stop the thread; False where the step in progress did not end
        within `wait_s` seconds (the thread is left to it: the caller may exit without it)."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            return False
        cancel_all([*self._waiting, *self._running, *(self._prefill.sequences if self._prefill else [])])
        self._waiting.clear()
        self._running, self._prefill, self._cache, self._mask = [], None, None, None
        return True

    def abort(self, error: BaseException) -> None:
        """Fail every sequence held (their iterators raise `error`) and refuse new ones with it, from any
        thread, without waiting for the step in progress: for a model that can no longer run (a lost
        tensor-parallel rank), where that step may never end."""
        with self._condition:
            self._closed = True
            self._aborted = error
            held = [*self._waiting, *self._running, *(self._prefill.sequences if self._prefill else [])]
            self._condition.notify()
        for sequence in held:
            sequence.fail(error)

    # -- the loop ----------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._condition:
            self._condition.notify()

    def _warm_up(self) -> None:
        """Under a memory bound, one pass over streamed blocks before the first admission: the reader's
        buffers are then allocated and in use, so admission measures the memory really left rather than
        guessing what the first pass will take (a guess that holds a first burst back; docs/BENCHMARKS.md,
        section "Many tokens per weight read"), and every block has been checksummed. A failure here (a corrupt store) is left for the first request
        to meet and report."""
        if not (self.memory_bound and getattr(self.model, "stream_working_set", 0)):
            return
        self.model.leave_memory_to_a_batch()   # the page cache will not keep the blocks: read them directly
        try:
            with torch.no_grad():
                self.model(torch.tensor([[self.pad_token_id]], device=self.device), use_cache=False)
        except Exception:  # noqa: BLE001 - the first request meets it again, where it is reported
            log.debug("warm-up pass failed", exc_info=True)

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not (self._closed or self._waiting or self._running or self._prefill):
                    self._condition.wait()
                if not (self._running or self._prefill):
                    self._gather()
                if self._closed:
                    return
            self._guarded(self._drop_cancelled, running=True)   # its cache operation may fail (a lost TP rank)
            if self._prefill is None:
                self._prefill = self._admit()
            if self._prefill is not None:
                self._guarded(self._prefill_step, running=False)
            if self._running:
                self._guarded(self._decode_step, running=True)

    def _gather(self) -> None:
        """An idle engine that gets a request waits until no other has arrived for `gather_seconds` (at
        most GATHER_ROUNDS times that in all, or until a full batch waits), so that requests sent together
        start together. Alone, the first would take a pass over the blocks for its prefill, then one more
        per chunk of the others' prefill, each a whole weight read for one token (a dynamic batcher's queue
        delay; docs/BENCHMARKS.md, section "Many tokens per weight read"). Holds the condition."""
        started = time.monotonic()
        while not self._closed and len(self._waiting) < self.max_batch_size:
            arrived = len(self._waiting)
            left = min(self.gather_seconds, started + GATHER_ROUNDS * self.gather_seconds - time.monotonic())
            if left <= 0 or (not self._condition.wait(left) and len(self._waiting) == arrived):
                return

    def _guarded(self, step: Callable[[], None], running: bool) -> None:
        """A failing step fails the sequences it was serving, the running batch or the prefilling group (their
        iterators raise), and the rest goes on. Taken before the step, which may replace the lists."""
        sequences = list(self._running if running else self._prefill.sequences)
        try:
            step()
        except Exception as error:  # noqa: BLE001 - reported to each affected consumer
            log.error("a batch step failed; failing %d sequence(s): %s", len(sequences), error,
                      exc_info=not isinstance(error, ShardstreamError))   # ours say what happened
            for sequence in sequences:
                sequence.fail(error)
            if running:
                self._running, self._cache, self._mask = [], None, None
            else:
                self._prefill = None

    def _drop_cancelled(self) -> None:
        with self._condition:
            for sequence in [s for s in self._waiting if s.cancel_reason]:
                self._waiting.remove(sequence)
                sequence.emit(TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
        if self._prefill:
            for sequence in self._prefill.sequences:
                if sequence.cancel_reason and not sequence.done:
                    sequence.emit(TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
        for sequence in self._running:
            if sequence.cancel_reason and not sequence.done:
                sequence.emit(TokenEvent(NO_TOKEN, None, sequence.cancel_reason))
        self._keep_unfinished()

    def _room(self) -> int | None:
        """Bytes the batch may still take now (None: no memory bound)."""
        return self._memory_left() if self.memory_bound else None

    def _admit(self) -> _Prefill | None:
        """Take waiting sequences while the batch size, the KV-cache budget and the memory left allow; say
        which bound bit. A sequence that does not fit waits for running ones to finish. One alone is
        admitted with as few tokens ahead as the memory left holds (its cache grows later, or it ends with
        "length"); where not even its prompt fits, it fails with InsufficientMemory (a 503 from the
        server) rather than run into the kernel's kill. With none running the group's prefill passes may
        take `idle_prefill_tokens`, or `prefill_chunk_tokens` where only those fit."""
        group: list[Sequence] = []
        refused: list[tuple[Sequence, InsufficientMemory]] = []
        chunk, ahead = self.prefill_chunk_tokens if self._running else self.idle_prefill_tokens, KV_AHEAD_TOKENS
        bound, limit = None, None   # which bound bit (said once per change, not per step), and its details
        free = self._room() if self._waiting else None
        with self._condition:
            while self._waiting:
                if len(self._running) + len(group) >= self.max_batch_size:
                    bound = limit = f"max_batch_size={self.max_batch_size}"
                    break
                candidate = [*group, self._waiting[0]]
                kv, needed = self.memory_needs(candidate, chunk)
                if free is not None and needed > free and chunk > self.prefill_chunk_tokens:
                    smaller = self.memory_needs(candidate, self.prefill_chunk_tokens)
                    if smaller[1] <= free or not group:   # it fits chunked; or it goes alone: the least memory
                        chunk, (kv, needed) = self.prefill_chunk_tokens, smaller
                alone = len(self._running) + len(candidate) == 1
                if not alone and self.kv_cache_budget is not None and kv > self.kv_cache_budget:
                    bound = limit = f"the KV-cache budget of {self.kv_cache_budget} bytes"
                    break
                if free is not None and needed > free:
                    if not alone:
                        bound = "memory"
                        limit = f"memory ({max(free, 0) >> 20} MiB left for the batch, {needed >> 20} MiB needed)"
                        break
                    ahead, needed = self._fit_ahead(candidate, chunk, free)
                    if needed > free and self.forward_passes:   # before the first pass, the room is an underestimate
                        refused.append((self._waiting.popleft(), _no_room(candidate[0], needed, free)))
                        continue
                group.append(self._waiting.popleft())
            waiting = len(self._waiting)
        for sequence, error in refused:
            log.warning("%s", error)
            sequence.fail(error)
        if bound != self._limit and bound is not None:
            log.info("batch limited by %s: %d running, %d admitted, %d waiting",
                     limit, len(self._running), len(group), waiting)
        self._limit = bound
        if not group:
            return None
        longest = max(s.prompt_tokens for s in group)
        ids = torch.full((len(group), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for row, sequence in enumerate(group):
            ids[row, longest - sequence.prompt_tokens:] = torch.tensor(sequence.prompt_ids)
            mask[row, longest - sequence.prompt_tokens:] = 1
        return _Prefill(group, ids.to(self.device), mask.to(self.device), chunk, ahead)

    def _fit_ahead(self, alone: list[Sequence], chunk_tokens: int, free: int) -> tuple[int, int]:
        """The most tokens ahead (halved from KV_AHEAD_TOKENS down to 1) whose needs fit `free` bytes, for
        one sequence alone, and those needs; the needs of 1 when none fits."""
        ahead = KV_AHEAD_TOKENS
        needed = self.memory_needs(alone, chunk_tokens, ahead)[1]
        while ahead > 1 and needed > free:
            ahead //= 2
            needed = self.memory_needs(alone, chunk_tokens, ahead)[1]
        return ahead, needed

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, all_logits: bool) -> torch.Tensor:
        """One pass over the blocks for every row; the new columns are the last ids.shape[1] of `mask`."""
        with torch.no_grad(), pass_memory.reusing():
            out = self.model(ids, attention_mask=mask, position_ids=_positions(mask)[:, -ids.shape[1]:],
                             past_key_values=cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        self.forward_passes += 1
        if self._on_pass is not None:
            self._on_pass(*ids.shape)
        return out.logits

    def _prefill_step(self) -> None:
        group = self._prefill
        if group.cache is None:
            # the prompts only: widened for the tokens to come once prefilled (below), so that the prefill's
            # activations and the whole batch's widest cache are never in memory together
            group.cache = self.cache_ops.reserved_cache(group.ids.shape[1])
        rows = len(group.sequences)
        start = group.done_columns
        end = min(group.ids.shape[1], start + max(1, group.chunk_tokens // rows))
        echo = any(s.params.prompt_logprobs for s in group.sequences)
        logits = self._forward(group.ids[:, start:end], group.mask[:, :end], group.cache, echo)
        group.done_columns = end
        if echo:
            group.logits.append(logits)
        if end < group.ids.shape[1]:
            return
        self._prefill = None
        if echo:
            self._prompt_logprobs(group)
        for row, sequence in enumerate(group.sequences):
            if not sequence.done:
                self._advance(sequence, logits[row, -1])
        keep = [row for row, s in enumerate(group.sequences) if not s.done]
        if not keep:
            return
        kept = [group.sequences[row] for row in keep]
        # joining alone, the group's cache becomes the batch's and is widened now; else the merge reserves
        ahead = 0 if self._running else min(group.ahead, max(map(_ahead, kept)))
        mask = self.cache_ops.select(group.cache, group.mask, keep, ahead)
        if self._running:
            remaining = max(map(_ahead, [*self._running, *kept]))
            self._mask = self.cache_ops.merge(self._cache, self._mask, group.cache, mask, remaining)
        else:
            self._cache, self._mask = group.cache, mask
        self._running.extend(kept)
        used = sum(layer.keys.nbytes + layer.values.nbytes for layer in kvcache.filled_layers(self._cache))
        self.shape = replace(self.shape, kv_per_token=max(1, used // self._mask.numel()))

    def _prompt_logprobs(self, group: _Prefill) -> None:
        logprobs = torch.log_softmax(torch.cat(group.logits, 1).float(), -1)
        width = group.ids.shape[1]
        for row, sequence in enumerate(group.sequences):
            if sequence.params.prompt_logprobs:
                first = width - sequence.prompt_tokens
                sequence.prompt_logprobs = prompt_scores(logprobs[row, first:], sequence.prompt_ids,
                                                         sequence.params.logprobs or 0)

    def _decode_step(self) -> None:
        self._grow()
        if not self._running:
            return
        ids = torch.tensor([[s.generated[-1]] for s in self._running], device=self.device)
        mask = torch.cat([self._mask, self._mask.new_ones((len(self._running), 1))], 1)
        logits = self._forward(ids, mask, self._cache, False)
        self._mask = mask
        for row, sequence in enumerate(self._running):
            if not sequence.done:
                self._advance(sequence, logits[row, -1])
        self._keep_unfinished()

    def _advance(self, sequence: Sequence, logits: torch.Tensor) -> None:
        token, logprob = choose_token(sequence, logits)
        sequence.generated.append(token)
        self.tokens_generated += 1
        finish = ("stop" if token in self.eos_token_ids
                  else "length" if len(sequence.generated) >= sequence.params.max_new_tokens else None)
        sequence.emit(TokenEvent(token, logprob, finish))

    def _grow(self) -> None:
        """Before a decode step with no column of the reservation left: widen it by the most tokens a row
        has ahead, or by as many as the memory left holds. Where not even one more column fits, end the
        sequence that has generated the most with finish_reason "length" (every row costs the same:
        the batch is left-padded), until the others' next column fits."""
        while self._running and self._mask.shape[1] >= kvcache.reserved_columns(self._cache):
            free, columns = self._room(), max(map(_ahead, self._running))
            while free is not None and columns and self._growth_needs(columns) > free:
                columns //= 2
            if columns:
                self._mask = self.cache_ops.select(self._cache, self._mask, list(range(len(self._running))), columns)
                return
            ended = max(self._running, key=lambda s: len(s.generated))
            log.warning("ended a sequence after %d tokens with finish_reason \"length\": its KV cache cannot grow in "
                        "the memory left (%d MiB left, %d MiB needed for one more token)", len(ended.generated),
                        max(free, 0) >> 20, self._growth_needs(1) >> 20)
            ended.emit(TokenEvent(NO_TOKEN, None, "length"))
            self._keep_unfinished()

    def _growth_needs(self, columns: int) -> int:
        """Bytes beyond the running batch's reservation that widening it by `columns` takes: the wider one,
        built a layer at a time beside the old (kvcache.select), then a decode pass over it."""
        rows, width = len(self._running), self._mask.shape[1]
        allocated = kvcache.reserved_bytes(self._cache)
        grown = kv_peak(self.shape, rows, width, columns)
        return grown + max(allocated // self.shape.layers, self.shape.pass_bytes(rows, 1, width + columns, 1)) - allocated

    def _keep_unfinished(self) -> None:
        """Drop finished rows from the batch; the rest keep the columns they had ahead (never more: only
        `_grow` widens, within the memory left)."""
        keep = [row for row, s in enumerate(self._running) if not s.done]
        if len(keep) == len(self._running):
            return
        left = kvcache.reserved_columns(self._cache) - self._mask.shape[1]
        self._running = [self._running[row] for row in keep]
        if keep:
            self._mask = self.cache_ops.select(self._cache, self._mask, keep, min(left, max(map(_ahead, self._running))))
        else:
            self._cache, self._mask = None, None


def _no_room(sequence: Sequence, needed: int, free: int) -> InsufficientMemory:
    return InsufficientMemory(
        f"a prompt of {sequence.prompt_tokens} tokens needs {needed >> 20} MiB (its KV cache and a pass's "
        f"temporaries) but this process has {max(free, 0) >> 20} MiB left; send a shorter prompt, or give the "
        "process more memory.")
