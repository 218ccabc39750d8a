"""Every SHARDSTREAM_* environment variable shardstream reads, read here only: its name, its default and what
it changes (docs/TROUBLESHOOTING.md lists them from `ALL`). A switch is read each time it is used, so a test or
a caller may set it at any time before that use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    what: str   # one line for the docs

    def get(self) -> str:
        """The value set (an empty value counts as unset), else the default."""
        return os.environ.get(self.name) or self.default

    def off(self) -> bool:
        """Whether an on/off switch is set to 0."""
        return self.get() == "0"

    def pop(self) -> str | None:
        """The value set, removed from this process's environment (a value meant for this process only)."""
        return os.environ.pop(self.name, None)


CPU_FLAGS = Switch("SHARDSTREAM_CPU_FLAGS", "", "comma-separated `-flag` (masked) and `+flag` (added) edits of the "
                   "CPU flags that `compute_dtype=\"auto\"` reads, e.g. `-avx512_bf16,-amx_bf16` to take the path of "
                   "a CPU without bf16 instructions")
DIRECT_IO = Switch("SHARDSTREAM_DIRECT_IO", "auto", "how streamed blocks are read: `auto`, `on` (O_DIRECT), `off` "
                   "(mapped) or `dropped` (ordinary reads dropped from the page cache)")
CACHE = Switch("SHARDSTREAM_CACHE", "", "where a checkpoint or Hub id given to generate, serve or `from_pretrained` "
               "is converted to (default `~/.cache/shardstream`)")
HALF_KERNEL = Switch("SHARDSTREAM_HALF_KERNEL", "1", "`0`: bf16/fp16 weights in float32 math are converted a few MB at "
                     "a time for each product instead of multiplied as stored by the native kernel")
QUANT_KERNEL = Switch("SHARDSTREAM_QUANT_KERNEL", "1", "`0`: 4-bit and 8-bit weights are dequantized on every pass "
                      "instead of multiplied from their codes on the CPU")
INT4_KERNEL = Switch("SHARDSTREAM_INT4_KERNEL", "1", "`0`: int4 weights are dequantized on every pass instead of "
                     "multiplied with int8 dot products")
ATTENTION_KERNEL = Switch("SHARDSTREAM_ATTENTION_KERNEL", "1", "`0`: a decode step's attention on the CPU runs "
                          "torch's SDPA instead of the native kernel that shares it among the threads of the products")
NORM_KERNEL = Switch("SHARDSTREAM_NORM_KERNEL", "1", "`0`: RMSNorm of float32 rows on the CPU runs transformers' "
                     "forward instead of the native kernel")
TRITON = Switch("SHARDSTREAM_TRITON", "1", "`0`: on a GPU, 4-bit and 8-bit weights are dequantized instead of "
                "multiplied from their codes by the Triton kernel")
PASS_MEMORY = Switch("SHARDSTREAM_PASS_MEMORY", "1", "`0`: a pass maps its large activations anew for every "
                     "operation instead of reusing them within the pass")
COPY_AHEAD = Switch("SHARDSTREAM_COPY_AHEAD", "1", "`0`: on a GPU, streamed pieces are copied to it on the reader "
                    "threads, not queued on a copy stream ahead of their use")
WORK_POOL = Switch("SHARDSTREAM_WORK_POOL", "1", "`0`: the native kernels split a decode step's products over "
                   "torch's OpenMP threads, not over threads of their own that stay awake between the products "
                   "(they do so only where OpenMP's threads sleep: OMP_WAIT_POLICY=PASSIVE, shardstream's default)")
TOKEN = Switch("SHARDSTREAM_TOKEN", "", "the pipeline's shared secret, for `agent` and `coordinator` (`--token`)")
API_KEY = Switch("SHARDSTREAM_API_KEY", "", "the key `serve` and `coordinator --serve-port` require (`--api-key`)")
PARENT_PID = Switch("SHARDSTREAM_PARENT_PID", "", "set by a process that starts local pipeline agents, so that they "
                    "stop with it; not for users")

ALL = (CPU_FLAGS, DIRECT_IO, CACHE, HALF_KERNEL, QUANT_KERNEL, INT4_KERNEL, ATTENTION_KERNEL, NORM_KERNEL, TRITON,
       PASS_MEMORY, COPY_AHEAD, WORK_POOL, TOKEN, API_KEY, PARENT_PID)
