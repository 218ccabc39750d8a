"""How many more sequences the running batch can take without running out of memory.

Checked at every admission against the memory really left (`available_memory`, a cgroup cap
included), not once when the engine starts: a budget fixed at start counted as free the bytes that
the streamed blocks take only on the first pass (the reader's O_DIRECT buffers), enough to get a
burst of requests killed under a cap (docs/BENCHMARKS.md, section "Many tokens per weight read"). The
engine therefore makes one pass before it admits anything (`BatchEngine._warm_up`). A candidate batch fits when what it still needs (its KV
cache reservation and a pass's activations, at the worst of its prefill, its merge and its last
token) stays within what is available now minus a fixed slack for the server's own objects. The
engine (`batching.py`) does the bookkeeping; this module the sizes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass

import torch

from ..memory import gpu_free_bytes
from ..memory import available_memory

SLACK = 32 << 20     # never planned: request objects, tokenizer calls, allocator fragments, a reader thread's stack
SAFETY = 1.25        # activation estimates x this: transformers keeps a few more temporaries than counted
MIN_PREFILL_CHUNK = 32       # below this the passes' weight reads, not the activations, are what a prompt costs
M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20   # allocations from this size get their own mapping (see map_large_allocations)


@dataclass(frozen=True)
class Shape:
    """The sizes that set a pass's memory, from the model's config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    kv_per_token: int    # keys and values of one token over all layers, bytes
    element: int         # bytes per activation element
    kv_heads: int        # fewer than heads (grouped-query attention): attention may repeat a layer's keys and values
    experts_per_token: int = 0   # a mixture of experts' top k (0: a dense MLP)

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> Shape:
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = 1 if getattr(text, "multi_query", False) else (
            getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        element = torch.tensor([], dtype=dtype).element_size()
        intermediate = (getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
                        or 4 * text.hidden_size)
        return cls(layers=text.num_hidden_layers, hidden=max(text.hidden_size, heads * head_dim),
                   intermediate=intermediate, heads=heads, vocab=text.vocab_size,
                   kv_per_token=2 * text.num_hidden_layers * kv_heads * head_dim * element, element=element,
                   kv_heads=kv_heads, experts_per_token=getattr(text, "num_experts_per_tok", None) or 0)

    def pass_bytes(self, rows: int, new_columns: int, width: int, logit_columns: int) -> int:
        """Peak temporaries of one pass over the blocks: per new token 6 hidden-sized states (residual,
        norm, attention input and output, a projection, a rotary or norm temporary) and 4 of the MLP's
        intermediate size (a fused gate_up is two, then the activation and the product; a mixture of
        experts runs each of its top k experts on a gathered copy of the token, with that copy and its
        output besides), the attention scores and their softmax, one layer's keys and values repeated for
        grouped heads (the reserved cache itself is written in place, see kvcache.py), and the logits
        kept, with their float and log-softmax copies; times SAFETY. Too little lets a batch outgrow its
        cap, too much holds requests back, so tests/test_serving_admission.py keeps it above every family's
        measured peak (the figures: docs/BENCHMARKS.md, section "Many tokens per weight read")."""
        tokens = rows * new_columns
        mlp = (self.experts_per_token * (4 * self.intermediate + 2 * self.hidden) if self.experts_per_token
               else 4 * self.intermediate)
        per_token = (6 * self.hidden + mlp) * self.element
        scores = 2 * rows * self.heads * new_columns * width * self.element
        repeated = self.heads // self.kv_heads if self.kv_heads < self.heads else 0
        layer_kv = rows * width * self.kv_per_token // self.layers * repeated
        logits = rows * logit_columns * self.vocab * (self.element + 8)
        return int(SAFETY * (tokens * per_token + scores + layer_kv + logits))


def room(device: torch.device) -> int:
    """Bytes the batch may still take now on `device` (its KV caches and activations live there):
    available memory minus SLACK. Freed heap memory is given back to the system first, or it would
    count as used."""
    if device.type == "cuda":
        return gpu_free_bytes(device) - SLACK
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    return available_memory()[0] - SLACK


def map_large_allocations() -> None:
    """Have glibc give every allocation of MMAP_THRESHOLD or more its own mapping, returned to the system
    when freed. A KV cache grows by a new, slightly larger tensor per layer per step; from glibc's heap
    (where its adaptive threshold puts tensors of a few MB) the freed smaller ones cannot be reused and
    the process grows beyond what admission planned (docs/BENCHMARKS.md, section "Many tokens per weight
    read"). Process-wide and idempotent; a no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


@functools.cache
def _libc():
    """glibc (it has malloc_trim and mallopt), or None for another C library."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def kv_peak(shape: Shape, rows: int, width: int, remaining: int) -> int:
    """KV bytes of `rows` left-padded rows once `width` columns have grown by `remaining` more tokens."""
    return rows * (width + remaining) * shape.kv_per_token


def prefill_chunk(shape: Shape, rows: int, length: int, new_tokens: int, free: int) -> int:
    """Tokens per pass of `generate`'s prefill of `rows` prompts `length` tokens long that will grow by
    `new_tokens`: the whole prompt, or halved (down to MIN_PREFILL_CHUNK) until the pass's activations
    (`Shape.pass_bytes`, the last chunk's attention spanning the whole prompt) plus the KV cache at its
    widest fit `free` bytes. Every chunk is one more read of the streamed blocks, so a prompt is chunked
    only when the memory left asks for it (docs/BENCHMARKS.md, section "Long prompts")."""
    kv = kv_peak(shape, rows, length, new_tokens)
    chunk = length
    while chunk > MIN_PREFILL_CHUNK and kv + shape.pass_bytes(rows, chunk, length, 1) > free:
        chunk = -(-chunk // 2)
    return max(chunk, min(length, MIN_PREFILL_CHUNK))


def prefill_passes(rows: int, longest: int, chunk_tokens: int) -> tuple[int, int]:
    """(passes, columns per pass) of prefilling `rows` prompts of at most `longest` tokens, as the engine chunks."""
    columns = min(longest, max(1, chunk_tokens // rows))
    return math.ceil(longest / columns), columns
