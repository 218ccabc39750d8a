"""transformers' RMSNorm in one native call for float32 rows on the CPU.

Llama's RMSNorm (copied verbatim by Mistral, Qwen2, Qwen3, Mixtral and many more) runs seven torch operations on
a row: in a decode step, two norms a block, each a few microseconds of dispatch for a few microseconds of work
(docs/BENCHMARKS.md, "Beside llama.cpp on the CPU"). The engine's models (meta.py) give every module running
that code `lean_forward`: float32 rows on the CPU, with nothing to differentiate, go to `rms_norm.cpp`; every
other input runs transformers' own forward. The values equal transformers' within float32 rounding (the sum of
squares is added in another order). `SHARDSTREAM_NORM_KERNEL=0`, a CPU without AVX2 or no C++ compiler leave
transformers' forward to every call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .. import native
from ..switches import NORM_KERNEL
from .lean import use_forward

log = logging.getLogger("shardstream.stream")

SOURCE = Path(__file__).with_name("rms_norm.cpp")


def use_lean_norms(model: nn.Module) -> None:
    """Give every module of `model` whose forward is Llama's RMSNorm `lean_forward`."""
    use_forward(model, LlamaRMSNorm.forward, lean_forward)


def lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`weight * hidden_states / sqrt(mean(hidden_states²) + eps)`: by the native kernel for float32 rows on the
    CPU, else by transformers' forward."""
    weight = self.weight
    if (hidden_states.dtype != torch.float32 or weight.dtype != torch.float32 or hidden_states.device.type != "cpu"
            or weight.device.type != "cpu" or hidden_states.stride(-1) != 1 or not hidden_states.numel()
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            or _library() is None):
        return LlamaRMSNorm.forward(self, hidden_states)
    size = hidden_states.shape[-1]
    rows = hidden_states.reshape(-1, size)
    if rows.shape[0] > 1 and rows.stride(0) < size:
        rows = rows.contiguous()
    out = torch.empty(hidden_states.shape, dtype=torch.float32)
    _library().rms_norm(rows.data_ptr(), rows.shape[0], size, rows.stride(0), weight.data_ptr(),
                        self.variance_epsilon, out.data_ptr())
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    what, without = "RMSNorm kernel", "RMSNorm runs transformers' forward"
    library = native.build_vector_kernel(SOURCE, NORM_KERNEL, log, what, without)
    if library is not None:
        i64, pointer = ctypes.c_int64, ctypes.c_void_p
        library.rms_norm.argtypes = [pointer, i64, i64, i64, pointer, ctypes.c_float, pointer]
        library.rms_norm.restype = None
    return library
