"""The fused attention kernels a pass on a CUDA GPU may use: any of torch's but cuDNN's.

torch prefers cuDNN's attention on Hopper GPUs, and cuDNN builds an execution plan for each new shape: during
generation the keys grow by one every step, so every decode step of every block plans anew, on the host, while
the GPU waits. Flash and memory-efficient attention take any length with no planning; the math kernel stays the
fallback for inputs neither takes. On other devices nothing changes (cuDNN attention is CUDA's alone).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_PLANNING = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which scaled_dot_product_attention on `device` uses a kernel that needs no per-shape plan."""
    return sdpa_kernel(WITHOUT_PLANNING) if device.type == "cuda" else contextlib.nullcontext()
