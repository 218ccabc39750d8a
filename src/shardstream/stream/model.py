"""The streaming model: transformers' own model built on `meta`, each block filled just before it runs.

Forward pre-hooks on the decoder blocks put the block's weights in place (read ahead by the
prefetcher) and forward hooks take them out again, so every architecture keeps its own attention,
rotary embedding, masks and KV cache, and `generate()` works unchanged. Embeddings, final norm and
head are used for every token and stay resident, as do the first blocks that fit the memory budget.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from ..errors import DraftMismatch, InsufficientMemory, InvalidOption, StoreIncomplete, UnsupportedModel
from ..memory import available_memory
from ..quant import QuantizedTensor
from ..serving import pass_memory
from ..serving.admission import Shape, map_large_allocations, prefill_chunk, room
from ..serving.kvcache import generation_cache
from ..serving.text import check_context
from ..store import Store
from .attention import attention_kernels
from .blocks import StreamedBlocks, fill_block
from .ends import Ends
from .habits import TransformersHabits
from .engine_options import EngineOptions, engine_options
from .experts import ExpertlessLoader, ExpertSource, OnDemandExperts, on_demand_advice
from .linear import packable_weights
from .loader import BlockLoader
from .mapped import release_unviewed
from .meta import WrapsModel, block_renames, build_meta_model, checkpoint_dtype, common_module
from . import pieces as splitting
from .pieces import Piece, held_through, largest_counted, split_block, whole, working_set
from .profile import Profile
from .report import EngineReport
from .residency import choose_resident
from .shapes import check_stored_shapes
from .weights import Slots, WeightMapper

# A pass of this many token rows or more is bound by its matrix products, not by the disk: its quantized
# pieces are dequantized by the computing thread, between its products, instead of by the readers beside
# them (where OpenMP teams fight for the cores); one row keeps the readers. docs/BENCHMARKS.md ("Quantized
# stores") has the measurements.
COMPUTE_BOUND_ROWS = 4
# Tokens per prefill pass at most where a pass reads nothing (every block and the head resident on the CPU):
# there a chunk costs no weight reads, its products run as fast as a longer one's, and its activations are
# a quarter of a 512-token pass's (docs/BENCHMARKS.md, "Beside llama.cpp on the CPU").
RESIDENT_PREFILL_CHUNK = 128


def _check_files(store: Store, parts: list[str]) -> None:
    """A deleted file of these parts would otherwise surface only when its block is first needed."""
    for name in dict.fromkeys(name for part in parts for name in store.read_files(part)):
        path = store.file_path(name)
        if not path.is_file():
            raise StoreIncomplete(
                f"{path} is missing; re-run the `shardstream convert` that made this store to repair it."
            )


def _block_range(store: Store, blocks: range | None) -> range:
    """The store's blocks a model runs: `blocks`, checked, or all of them."""
    count = store.num_layers
    if count == 0:
        raise UnsupportedModel(
            f"the store at {store.root} has no per-block parts (model_type "
            f"{store.config.get('model_type')!r} was stored one tensor per part); streaming needs blocks."
        )
    if blocks is None:
        return range(count)
    if blocks.step != 1 or not 0 <= blocks.start < blocks.stop <= count:
        raise InvalidOption(f"blocks {list(blocks)[:1]} to {list(blocks)[-1:]} are not a range of the {count} blocks "
                            f"of the store at {store.root} (0 to {count - 1}); re-plan.")
    return blocks


class StreamingModel(TransformersHabits, WrapsModel):
    """Call it like a transformers model (`model(ids).logits`, `model.generate(...)`). `max_seq_len`: the
    longest prompt plus new tokens a call may run (None: the model's context). `shape_model(model)` changes
    the meta model before anything is sized or read (a tensor-parallel rank's split modules, tp/model.py).
    `blocks`: run only these of the store's blocks (a pipeline stage's), numbered from 0 in `model`; the
    embedding is held only by a range that starts at the first block, the final norm and head only by one
    that ends at the last, and a later range's caller hands its first block the hidden states.
    `experts_from`: where experts='on_demand' reads the experts (experts.ExpertSource; default this store's, all)."""

    def __init__(self, store: Store, options: EngineOptions | None = None, *, device: str | torch.device = "cpu",
                 shape_model: Callable[[torch.nn.Module], None] | None = None, blocks: range | None = None,
                 experts_from: ExpertSource | None = None, **engine):
        """`options`: the engine's options as one value, or given one by one (`engine`: EngineOptions' fields)."""
        options = engine_options(options, engine)
        self.options = options
        self.store = store
        self.blocks = _block_range(store, blocks)
        parts = store.parts_of(self.blocks)   # what this model reads of the store
        outside = [part for part in parts if not part.startswith("mid/")]
        _check_files(store, parts)
        self.closed = False
        self.max_seq_len = options.max_seq_len
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidOption("device='cuda' was asked for but torch sees no CUDA GPU; use device='cpu'.")
        self.profiling_mode = options.profiling_mode
        self.profile = Profile()
        partial = self.blocks != range(store.num_layers)
        self.model = build_meta_model(store, options.compute_dtype, self.device, self.blocks if partial else None)
        self._checkpoint_element = checkpoint_dtype(store).itemsize   # blocks are cut by it (pieces.split_block)
        if shape_model is not None:
            shape_model(self.model)
        self._buffers_to_device()
        mapper = WeightMapper(self.model, block_renames(store, self.blocks) if partial else None)
        check_stored_shapes(store, self.model, mapper)
        self.experts = (OnDemandExperts(experts_from or ExpertSource(store), self.model, mapper, self.device, self.blocks,
                                        options.verify_checksums)
                        if options.experts == "on_demand" else None)
        self._loader = (ExpertlessLoader(store, mapper, self.device, options.verify_checksums, self.experts.checkpoint_names,
                                         self.blocks)
                        if self.experts else BlockLoader(store, mapper, self.device, options.verify_checksums, blocks=self.blocks))
        prefixes = self._block_prefixes(mapper)
        served = self.experts.module_names if self.experts else []   # experts on demand: never in a block's slots
        self._slots = [Slots(self.model.get_submodule(p), p, exclude=_inside(p, served)) for p in prefixes]
        self._check_blocks(mapper)
        unused = self._unused_modules(mapper, outside)
        self._loader.host_budget = options.host_budget(self.device)
        self._loader.pack_linear_weights(packable_weights(self.model), parts)
        self.block_modules = blocks = [self.model.get_submodule(p) for p in prefixes]   # the decoder blocks, in order
        pieces, prefetch_depth = self._read_ahead(blocks, prefixes, mapper, options)
        sizes = [self._bytes_in_memory(s, resident=True) for s in self._slots]
        # bytes the pieces in flight take once streaming starts (O_DIRECT buffers or mapped pages), out of the
        # resident budget; a batch engine makes its warm-up pass so that they are taken before it admits
        in_flight = prefetch_depth + 1 if options.prefetching else 1
        streaming = working_set(pieces, in_flight)
        self._ends = Ends(store, self.model, mapper, self.device, self._loader.packed_keys,
                          uses_embedding=self.blocks.start == 0,
                          uses_head=self.blocks.stop == store.num_layers)
        head_buffers = self._loader.piece_buffer_bytes()

        def place() -> int:
            """The resident budget left for blocks, once the small resident parts are in memory (a cgroup
            counts them) and the big embedding/head have been placed (ends.py)."""
            ends = self._ends.names
            fixed = (self._resident_slots.nbytes - self._ends.slot_bytes
                     - self._loader.packing_saves(self._resident_slots.names - ends, resident=True))
            budget = options.resident_budget(fixed, self.device)
            return budget - self._ends.place(budget, streaming)

        budget = self._fill_resident_parts(mapper, outside, prefixes + list(unused), place)
        self._ends_hooks = self._ends.hook(self._loader.pool, head_buffers, lambda: self._loader.reading,
                                           options.verify_checksums)
        self.resident_budget = budget   # what the resident blocks were chosen within, the ends placed
        # a streamed head's two slice buffers are the pool's piece buffers, but may be taken beside them
        self.resident_blocks = choose_resident(sizes, budget, streaming + (0 if self._ends.head_resident else 2 * head_buffers))
        streamed = [i for i in range(len(self._slots)) if i not in self.resident_blocks]
        if streamed:   # with every block resident, the choice made at load stands
            self._loader.choose_reading_again(0 if self._ends.head is None else self._ends.head.nbytes)
        for index in self.resident_blocks:
            fill_block(self._slots[index], self._loader.load(index, resident=True))
        self.pieces = {k: pieces[k] for k in streamed}
        self.stream_working_set = working_set(self.pieces, in_flight)
        if self.experts:
            self.experts.drop_pages = self.experts.count * self.experts.expert_bytes > available_memory()[0]
            auto = options.max_expert_memory == "auto"
            self.experts.fit(options.expert_budget(self.device, self.stream_working_set), auto=auto)
            self.experts.guessing = options.prefetching
            if auto:   # where they all fit, read at load (experts.preload)
                self.experts.preload()
        self._check_room()
        self.forward_passes = 0  # passes over the blocks (weight reads) in the last call: speculation's yardstick
        self._hooks = []
        if self.device.type == "cpu":
            # A pass's temporaries go back to the system when it ends, not into glibc's heap, where a prefill's
            # are scattered layer after layer and the process keeps the high-water mark (pass_memory.py). The
            # pass begins before any other pre-hook runs: the end hook runs even when one of them raises.
            map_large_allocations()
            pass_memory.install()
            self._hooks += [self.model.register_forward_pre_hook(lambda module, args: pass_memory.begin()),
                            self.model.register_forward_hook(lambda module, args, out: pass_memory.end(), always_call=True)]
        self._hooks.append(self.model.register_forward_pre_hook(self._count_pass, with_kwargs=True))
        piece_keys = [(k, i) for k in streamed for i in range(len(self.pieces[k]))]
        self._streaming = StreamedBlocks(blocks, self._slots, streamed, self._loader.load_piece,
                                         prefetch_depth if options.prefetching else None, self._released, self._settle,
                                         self.pieces, self._loader.held, lambda: self._loader.copies_only(piece_keys))

    # -- construction ------------------------------------------------------------------------

    def _buffers_to_device(self) -> None:
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(self.device)

    def _block_prefixes(self, mapper: WeightMapper) -> list[str]:
        prefixes = []
        for index in self.blocks:
            names = mapper.target_names(self.store.tensor_names(f"mid/{index}"))
            prefix = common_module(names) if names else ""
            if not prefix:
                raise UnsupportedModel(
                    f"part mid/{index} of the store at {self.store.root} does not map onto one module of "
                    f"{type(self.model).__name__}; this architecture cannot be streamed."
                )
            prefixes.append(prefix)
        return prefixes

    def _unused_modules(self, mapper: WeightMapper, outside: list[str]) -> tuple[str, ...]:
        """The modules outside its blocks that a range of blocks does not run (another stage's embedding, final
        norm or head): they stay on meta. A range after the first refuses a model that uses more than the token
        embedding before its blocks (GPT-2's position embedding), which its forward would still run."""
        others = [p for p in self.store.parts if not p.startswith("mid/") and p not in outside]
        unused = set().union(*(mapper.target_names(self.store.tensor_names(p)) for p in others))
        if self.blocks.start > 0:
            embedding = next(n for n, m in self.model.named_modules() if m is self.model.get_input_embeddings())
            before = [n for n in mapper.target_names(self.store.tensor_names("start")) if not n.startswith(embedding + ".")]
            if before:
                raise UnsupportedModel(
                    f"{type(self.model).__name__} uses {sorted(before)[:3]} before its blocks besides the token "
                    f"embeddings, so blocks from {self.blocks.start} on cannot run without them; run it whole "
                    "(plan it on one device).")
        return tuple(sorted({name.rpartition(".")[0] for name in unused}))

    def _check_blocks(self, mapper: WeightMapper) -> None:
        """Every block's parameters must come from its part, or the forward pass would meet meta tensors."""
        for index, slots in zip(self.blocks, self._slots):
            missing = slots.names - mapper.target_names(self.store.tensor_names(f"mid/{index}"))
            if missing:
                raise UnsupportedModel(
                    f"part mid/{index} of the store at {self.store.root} lacks {sorted(missing)[:3]}; "
                    "re-convert the checkpoint with this transformers version."
                )

    def _read_ahead(self, blocks: list[torch.nn.Module], prefixes: list[str], mapper: WeightMapper,
                    options: EngineOptions) -> tuple[dict[int, list[Piece]], int]:
        """The blocks' pieces (see `_split`) and how many are read ahead, from `options.piece_bytes` and
        `options.prefetch_depth`. Depth 'auto' on a CPU with the default pieces: blocks cut at half PIECE_BYTES,
        and as many pieces read ahead as fill the working set that PIECE_BYTES pieces with one read ahead would
        take. The same memory then holds more, smaller pieces, so both reader threads have one to read while a
        third computes: with O_DIRECT the disk works only on what is asked of it, and one piece at a time leaves
        it idle between pieces (docs/BENCHMARKS.md, section "Real shapes"); where a Linear alone exceeds half
        PIECE_BYTES (a 7B's MLP), or a block is read whole, nothing changes. Elsewhere (a GPU's copies, pieces
        asked for): one piece read ahead."""
        depth = options.prefetch_depth
        if depth != "auto" or options.piece_bytes is not None or self.device.type != "cpu":
            return self._split(blocks, prefixes, mapper, options.piece_bytes), 1 if depth == "auto" else depth
        default = splitting.PIECE_BYTES   # read at call time, as split_block does
        pieces = self._split(blocks, prefixes, mapper, default // 2)
        largest = largest_counted(pieces)
        before = largest_counted(self._split(blocks, prefixes, mapper, default, plan=False))
        return pieces, max(1, 2 * before // largest - 1) if largest else 1

    def _split(self, blocks: list[torch.nn.Module], prefixes: list[str], mapper: WeightMapper,
               limit: int | None, plan: bool = True) -> dict[int, list[Piece]]:
        """Each block's pieces (pieces.py: siblings grouped up to `limit` bytes), and (`plan`) the loader's
        plan for reading them; a block the loader cannot split (see BlockLoader.split) is one piece."""
        pieces: dict[int, list[Piece]] = {}
        reads: dict[tuple[int, int], list[str] | None] = {}
        for k, (block, prefix) in enumerate(zip(blocks, prefixes)):
            names = self._slots[k].names & mapper.target_names(self._loader.checkpoint_keys(k))
            split = split_block(block, prefix, names, limit, self._checkpoint_element)
            keys = self._loader.split(k, split)
            if keys is None:
                pieces[k] = whole(block, names, self._slots[k].nbytes - self._loader.packing_saves(names))
                reads[(k, 0)] = None
                continue
            split = [replace(p, nbytes=self._loader.held_bytes(p.names)) for p in split]
            kept = [0] + [i for i in range(1, len(split)) if keys[i]]
            # a piece with nothing to read (experts filled on demand) is in memory for the whole block, as piece 0 is
            unread = sum(p.nbytes for i, p in enumerate(split) if i not in kept)
            pieces[k] = [replace(split[0], nbytes=split[0].nbytes + unread), *(split[i] for i in kept[1:])]
            reads.update({(k, n): keys[i] for n, i in enumerate(kept)})
        if plan:
            self._loader.plan(reads, frozenset(key for key in reads if held_through(pieces[key[0]], key[1])))
        return pieces

    def _bytes_in_memory(self, slots: Slots, resident: bool) -> int:
        """A block's bytes once filled: packed weights (`resident`: those packed in resident parts too) at their
        packed size, the others in the model's dtype."""
        return slots.nbytes - self._loader.packing_saves(slots.names, resident=resident)

    def _check_room(self) -> None:
        """Refuse, before the first pass, a model whose largest streamed piece cannot fit in the memory left on
        the CPU (the kernel would kill the process mid-pass): one sentence saying what it needs and what to do.
        A Mixtral-8x7B block's experts are one tensor each in transformers: 2.8 GB of bf16 at once with its
        block; `experts='on_demand'` needs one expert at a time (0.35 GB)."""
        if self.device.type != "cpu" or not self.pieces:
            return
        piece = max((p for pieces in self.pieces.values() for p in pieces), key=lambda p: p.nbytes)
        need, where = piece.nbytes, os.path.commonprefix(sorted(piece.names)).rsplit(".", 1)[0]
        experts = self.experts.reading_bytes(ahead=False) if self.experts else 0
        if experts > need:
            need, where = experts, "one expert read on demand: its file's bytes, and its weights where converted"
        available, capped = available_memory()
        if need <= available:
            return
        limit = "the memory limit of its container (cgroup)" if capped else "the RAM available"
        advice = on_demand_advice(self.store) if self.experts is None else ""
        raise InsufficientMemory(
            f"streaming {self.store.root} needs {need >> 20} MiB at once ({where or ', '.join(sorted(piece.names))}), "
            f"but {limit} leaves {available >> 20} MiB once the resident parts are loaded; give it at least "
            f"{(need - available >> 20) + 1} MiB more, {advice}or stream a 4-bit store "
            "(`shardstream convert --compression 4bit`)."
        )

    def _fill_resident_parts(self, mapper: WeightMapper, outside: list[str], elsewhere: list[str],
                             place: Callable[[], int]) -> int:
        """Embeddings, final norm, head (and anything else outside the blocks) stay in memory, each read
        once (a tied head is the embedding's tensor, not a second copy), but for the big embedding/head
        that `place()` decides to stream (ends.py): their parts' other tensors are read one by one. The
        parts holding no such candidate are read first, so that `place` sees them in memory; returns what
        it returned. `outside`: the parts outside the blocks that this model reads; `elsewhere`: the modules not
        filled here (the blocks, and those a range of blocks does not run)."""
        self._resident_slots = Slots(self.model, exclude=tuple(elsewhere))
        held = [p for p in outside if mapper.target_names(self.store.tensor_names(p)) & self._ends.names]
        mappings: list = []
        aliased = self.blocks.start > 0   # a tied head's embedding read with it: a range after the start holds no other
        tensors = self._loader.read([p for p in outside if p not in held], resident=True, tied=aliased, mappings=mappings)
        budget = place()
        streamed = self._ends.streamed
        for part in held:
            keys = self.store.tensor_names(part)
            if mapper.target_names(keys) & streamed:
                tensors.update({k: self.store.load_tensor(k) for k in keys
                                if k in self.store.manifest.tensors and not mapper.target_names([k]) & streamed})
            else:
                tensors.update(self._loader.read([part], resident=True, tied=aliased, mappings=mappings))
        for alias, info in self.store.manifest.aliases.items():  # one tensor in memory for tied weights
            if info["target"] in tensors:
                tensors[alias] = tensors[info["target"]]
        params = mapper.convert(tensors)
        for tied, source in getattr(self.model, "all_tied_weights_keys", {}).items():
            if tied not in params and source in params:
                params[tied] = params[source]
        missing = self._resident_slots.names - params.keys() - streamed
        if missing:
            raise UnsupportedModel(
                f"the store at {self.store.root} lacks {sorted(missing)[:3]} outside the blocks; "
                "re-convert the checkpoint with this transformers version."
            )
        resident = {n: t if isinstance(t, QuantizedTensor) else t.to(self.device)   # packed: on the CPU
                    for n, t in params.items() if n in self._resident_slots.names}
        self._resident_slots.fill(resident)
        release_unviewed(mappings, resident.values())   # pages cast to the compute dtype (or moved to a GPU)
        return budget

    @property
    def reading(self) -> str:
        """How streamed blocks are read now: "direct" (O_DIRECT), "mapped" (through the page cache) or
        "dropped" (read, then dropped from the page cache); direct.READINGS."""
        return self._loader.reading

    @property
    def streamed_ends(self) -> set[str]:
        """The embedding and head parameters not held whole: an embedding read by rows, a head in slices."""
        return self._ends.streamed

    @property
    def packed_weights(self) -> frozenset[str]:
        """Checkpoint tensors multiplied as stored (4-bit/8-bit codes, or half precision beside float32 math)
        instead of converted into the compute dtype."""
        return self._loader.packed_keys

    @property
    def bytes_read(self) -> int:
        """Bytes of weights read from the store so far: the resident parts once, streamed pieces each time
        they are read (their tensors' own bytes, not the page rounding of O_DIRECT)."""
        return self._loader.bytes_read

    def report(self) -> EngineReport:
        """What the engine holds and does now, as one value (report.py): the resident blocks and each block's
        bytes, how the reader reads ahead and in which order, the pieces handed out and in place, the read
        buffers, what a GPU keeps in host RAM, how blocks are read, the weights multiplied as stored."""
        loader, streaming = self._loader, self._streaming
        order = streaming.order
        return EngineReport(
            resident_blocks=tuple(self.resident_blocks),
            block_bytes=tuple(self._bytes_in_memory(s, k in self.resident_blocks) for k, s in enumerate(self._slots)),
            read_ahead=streaming.read_ahead, prefetch_depth=streaming.depth,
            read_order=None if order is None else tuple(order), read_buffers=loader.pool.allocated,
            handed_out=streaming.handed_out, in_place=streaming.in_place,
            host_kept=loader.kept, host_kept_bytes=loader.kept_bytes, reading=loader.reading,
            packed_weights=len(loader.packed_keys),
            half_precision_weights=len(loader.mapper.held_as_stored & self.store.manifest.tensors.keys()),
            streamed_head_bytes=0 if self._ends.head_resident else self._ends.head.nbytes)

    # -- hooks -------------------------------------------------------------------------------

    def _count_pass(self, module, args, kwargs) -> None:
        """Count the pass; decide who dequantizes its quantized pieces (COMPUTE_BOUND_ROWS)."""
        self.forward_passes += 1
        tokens = next((t for t in (*args[:1], kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if t is not None), None)
        rows = tokens.shape[:2].numel() if isinstance(tokens, torch.Tensor) else 1
        self._loader.decode_in_reader = rows < COMPUTE_BOUND_ROWS

    def _settle(self) -> None:
        if self.profiling_mode and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _released(self, index: int, read: float, waited: float, seconds: float) -> None:
        self.profile.record(index, read, waited, seconds)

    # -- the transformers surface ------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor | None = None, **kwargs):
        """One forward pass (transformers' semantics: `.logits`, `past_key_values` ...)."""
        self.check_open()
        self.check_length(input_ids, 0)
        with torch.no_grad(), self._profiled(), attention_kernels(self.device):
            return self.model(input_ids=input_ids, **kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """transformers' `generate`: greedy or sampling, KV cache, attention masks, streamers.

        `assistant_model` (a StreamingModel or any transformers model) turns on transformers' assisted
        generation: the draft proposes tokens and one pass over the streamed blocks verifies them all.
        """
        self.check_open()
        new_tokens = kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 0
        self.check_length(input_ids, new_tokens)
        if input_ids is not None and kwargs.get("use_cache", True):
            if "prefill_chunk_size" not in kwargs:
                chunk = self.prefill_chunk(input_ids.shape[0], input_ids.shape[-1], new_tokens)
                if chunk < input_ids.shape[-1]:
                    kwargs["prefill_chunk_size"] = chunk
            if kwargs.get("past_key_values") is None:
                cache = generation_cache(self.config, input_ids.shape[-1] + new_tokens)
                if cache is not None:
                    kwargs["past_key_values"] = cache
        if kwargs.get("assistant_model") is not None:
            kwargs["assistant_model"] = self._assistant(kwargs["assistant_model"], "assistant_tokenizer" in kwargs)
        with self._profiled(), attention_kernels(self.device):
            return self.model.generate(input_ids=input_ids, **kwargs)

    def prefill_chunk(self, rows: int, length: int, new_tokens: int) -> int:
        """Tokens per pass of a prefill (transformers' chunked prefill: each chunk a pass over the blocks,
        its keys and values added to the cache), so that the prefill's activations and the KV cache fit the
        memory left now, in the compute dtype (admission.prefill_chunk); at most RESIDENT_PREFILL_CHUNK rows
        a pass where a pass reads no weights."""
        shape = Shape.of(self.config, self.model.dtype)
        chunk = prefill_chunk(shape, rows, length, new_tokens, room(self.device))
        reads_nothing = self.device.type == "cpu" and not self.pieces and not self.experts and self._ends.head_resident
        return min(chunk, max(1, RESIDENT_PREFILL_CHUNK // rows)) if reads_nothing else chunk

    def _assistant(self, draft, own_tokenizer: bool) -> PreTrainedModel:
        """The transformers model inside a StreamingModel draft (its hooks keep streaming it); a draft
        with another vocabulary needs transformers' universal assisted decoding (its own tokenizer)."""
        model = draft.model if isinstance(draft, StreamingModel) else draft
        if isinstance(draft, StreamingModel) and not hasattr(model.generate, "folds_generation_arguments"):
            model.generate = _folding_generation_arguments(model.generate)
        if model.config.get_text_config().vocab_size != self.config.get_text_config().vocab_size and not own_tokenizer:
            raise DraftMismatch(
                f"the draft model's vocabulary ({model.config.get_text_config().vocab_size} tokens) differs from the "
                f"target's ({self.config.get_text_config().vocab_size}); use a draft with the target's tokenizer, or "
                "pass tokenizer= and assistant_tokenizer= for transformers' universal assisted decoding."
            )
        return model

    def leave_memory_to_a_batch(self) -> None:
        """A batch engine will fill the memory left with KV caches: read the streamed blocks with O_DIRECT
        if 'auto' would have cached them (blocks that fit in the page cache at load time are then evicted
        and re-read under reclaim every pass; docs/BENCHMARKS.md, section "Quantized stores"); O_DIRECT
        rather than dropped reads, as a
        batch's pass is compute-bound and O_DIRECT copies nothing on the CPU. SHARDSTREAM_DIRECT_IO=off
        still wins."""
        self._loader.read_past_the_cache()

    def check_length(self, input_ids: torch.Tensor | None, new_tokens: int) -> None:
        """Refuse a prompt (plus the tokens to generate) longer than the model's context or `max_seq_len`."""
        if input_ids is None:
            return
        if not isinstance(input_ids, torch.Tensor):
            raise InvalidOption(f"input_ids must be a tensor of token ids, not a {type(input_ids).__name__}; make "
                                "one with model.tokenizer(text, return_tensors=\"pt\").input_ids.")
        check_context(self.model.config, input_ids.shape[-1], new_tokens)
        if self.max_seq_len and input_ids.shape[-1] + new_tokens > self.max_seq_len:
            raise InvalidOption(
                f"the prompt ({input_ids.shape[-1]} tokens) plus max_new_tokens ({new_tokens}) is more than the "
                f"max_seq_len={self.max_seq_len} given to from_pretrained; shorten the prompt, ask for fewer new "
                "tokens or raise max_seq_len."
            )

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        """Timings of one call; printed to stderr in profiling mode."""
        self.profile.reset()
        self.forward_passes = 0
        yield
        if self.profiling_mode:
            print(self.profile.table(self.resident_blocks, len(self._slots)), file=sys.stderr)

    def close(self) -> None:
        """Stop the prefetch thread, drop the hooks, unpin the read buffers."""
        self.closed = True
        for hook in self._hooks + self._ends_hooks:
            hook.remove()
        self._hooks.clear()
        self._ends_hooks.clear()
        self._streaming.close()
        self._loader.close()
        if self.experts:
            self.experts.close()

    def __enter__(self) -> StreamingModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _folding_generation_arguments(generate):
    """transformers' assisted decoding calls the draft's `generate` with a generation config and,
    beside it, arguments its own `generate` deprecates passing with one (min_new_tokens,
    max_new_tokens, use_cache: a warning on every `--draft` run); this folds them into a copy of the
    config first, which is what `generate` does with them anyway."""

    def call(*args, generation_config=None, **kwargs):
        if generation_config is not None:
            generation_config = copy.deepcopy(generation_config)
            kwargs = generation_config.update(**kwargs)   # returns the arguments that are not its fields
        return generate(*args, generation_config=generation_config, **kwargs)

    call.folds_generation_arguments = True
    return call


def _inside(prefix: str, names: list[str]) -> tuple[str, ...]:
    """`names` of modules inside the module at `prefix`, relative to it."""
    return tuple(name[len(prefix) + 1:] for name in names if name.startswith(prefix + "."))
