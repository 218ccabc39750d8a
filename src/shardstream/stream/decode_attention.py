"""Attention of a decode step on the CPU by a native kernel; every other call by torch's SDPA, as transformers makes it.

A decode step's attention is one query row a sequence against its cached keys and values: a few microseconds of
work that torch's scaled_dot_product_attention splits over its OpenMP threads, which under shardstream's
OMP_WAIT_POLICY=PASSIVE sleep between calls, so each block's call waits for them to wake
(docs/BENCHMARKS.md, "Beside llama.cpp on the CPU"). `decode_attention.cpp` shares the call among the threads
that stay awake between the step's products (work_pool.h) instead.

The engine's models (meta.py) run transformers' "sdpa" attention under the name `NAME`, registered here with
transformers' own SDPA mask: `attention` takes the calls it can compute the way SDPA does (float32 on the CPU,
one query row, no mask, no dropout, nothing to differentiate) and hands every other to transformers' SDPA
function unchanged. Its outputs equal SDPA's within float32 rounding (tests/test_stream_decode_attention.py).
`SHARDSTREAM_ATTENTION_KERNEL=0`, a CPU without AVX2 or no C++ compiler leave every call to SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import native
from ..switches import ATTENTION_KERNEL

log = logging.getLogger("shardstream.stream")

NAME = "shardstream"   # the attention implementation the engine's models run under
SOURCE = Path(__file__).with_name("decode_attention.cpp")
# Arguments transformers' SDPA function acts on that the kernel does not: a call with any of them goes to SDPA.
SDPA_ONLY = ("softcap", "position_bias", "cache", "s_aux", "sinks", "output_attentions")


def use_decode_attention(model: nn.Module) -> None:
    """Run `model`'s attention under `NAME` where it runs transformers' SDPA through transformers' attention
    interface (other implementations, and families that call SDPA themselves, are left as they are)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and model._can_set_attn_implementation():
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        model.set_attn_implementation(NAME)


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [B, 1, heads, D] by the kernel for a decode step it computes (`takes`),
    else `sdpa_attention_forward` with the same arguments."""
    if not takes(query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    out = torch.empty(batch, 1, heads, dim)
    _library().decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
        key.stride(2), value.data_ptr(), value.stride(0), value.stride(1), value.stride(2), batch, heads,
        key.shape[1], key.shape[2], dim, dim ** -0.5 if scaling is None else scaling, out.data_ptr())
    return out, None


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
          dropout: float, kwargs: dict) -> bool:
    """Whether the kernel computes this call: one float32 query row a sequence on the CPU, keys and values of the
    query's head size whose last dimension is contiguous, heads a whole multiple of theirs, no mask, no dropout,
    no gradient to record, none of `SDPA_ONLY`, and the kernel built."""
    tensors = (query, key, value)
    return (attention_mask is None and not dropout
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 4 and t.stride(-1) == 1
                    for t in tensors)
            and query.shape[2] == 1
            and key.shape[-1] == value.shape[-1] == query.shape[-1] and key.shape[:3] == value.shape[:3]
            and key.shape[0] == query.shape[0] and key.shape[2] > 0 and query.shape[1] % key.shape[1] == 0
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and all(kwargs.get(name) is None or kwargs.get(name) is False for name in SDPA_ONLY)
            and _library() is not None)


@functools.cache
def _library() -> ctypes.CDLL | None:
    what, without = "decode attention kernel", "a decode step's attention runs torch's SDPA"
    library = native.build_vector_kernel(SOURCE, ATTENTION_KERNEL, log, what, without,
                                         ("-fno-trapping-math", "-fopenmp"), ("c10", "torch_cpu"))
    if library is not None:
        i64, pointer = ctypes.c_int64, ctypes.c_void_p
        library.decode_attention.argtypes = [pointer, i64, i64, pointer, i64, i64, i64, pointer, i64, i64, i64,
                                             i64, i64, i64, i64, i64, ctypes.c_float, pointer]
        library.decode_attention.restype = None
    return library
