"""The dtype a streamed model computes in: the checkpoint's where the device multiplies it fast, else float32.

Real checkpoints are bfloat16 or float16. A CPU without bfloat16 instructions (AVX512_BF16 or AMX) runs
bfloat16 products through conversions, slower than float32; a CPU with them runs bfloat16 faster than
float32. float16 likewise needs AVX512_FP16 or AMX-FP16 (docs/BENCHMARKS.md, section "Products from
bf16/fp16 weights on the CPU"). Where the checkpoint's dtype is slow, the model is built in float32 ("bfloat16 weights, float32 math"): its Linear weights, embedding
and head stay in memory as stored and are multiplied in float32 by half_linear.py (loader.BlockLoader.
pack_linear_weights), so neither the reads nor the memory double; only small tensors (norms, biases)
are converted. GPUs keep the checkpoint's dtype (bfloat16 where the GPU supports it).

`cpu_flags` is the one place that reads the CPU's flags; `SHARDSTREAM_CPU_FLAGS` edits what it reports
("-avx512_bf16,-amx_bf16" takes the path of a CPU without them, "+avx512_bf16" that of one with them),
so that a user, a test or a benchmark can choose either path on any machine.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..errors import InvalidOption
from ..switches import CPU_FLAGS

log = logging.getLogger("shardstream.compute_dtype")

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags any one of which makes products in that dtype faster than in float32
FAST_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
CPUINFO = Path("/proc/cpuinfo")


def parse_compute_dtype(value: str | torch.dtype | None, option: str = "compute_dtype") -> torch.dtype | None:
    """`compute_dtype` as given (a name, a torch dtype, or 'auto'/None) -> a dtype, None for auto; `option`
    names it in the error."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[value.removeprefix("torch.")]
    raise InvalidOption(f"{option} {value!r} is not one shardstream computes in; use auto, "
                        f"{', '.join(COMPUTE_DTYPES)}.")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (none where there is no /proc/cpuinfo), edited by
    $SHARDSTREAM_CPU_FLAGS."""
    flags = set(_listed_flags())
    for entry in filter(None, (part.strip() for part in CPU_FLAGS.get().split(","))):
        if entry[0] not in "+-" or len(entry) == 1:
            raise InvalidOption(f"{CPU_FLAGS.name} entry {entry!r} is neither -flag (mask it) nor +flag (add it); "
                                f"write e.g. {CPU_FLAGS.name}=-avx512_bf16,-amx_bf16.")
        (flags.add if entry[0] == "+" else flags.discard)(entry[1:])
    return frozenset(flags)


@functools.cache
def _listed_flags() -> frozenset[str]:
    try:
        text = CPUINFO.read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def choose(stored: torch.dtype, device: torch.device, flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """The compute dtype `auto` picks for a checkpoint stored in `stored`, and why (for the log)."""
    name = str(stored).removeprefix("torch.")
    if stored not in FAST_CPU_FLAGS:
        return stored, f"the checkpoint's dtype, {name}"
    if device.type == "cuda":
        if stored == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float32, "the checkpoint is bfloat16, which this GPU does not compute natively"
        return stored, f"the checkpoint's dtype, {name}, on {device.type}"
    if device.type != "cpu":
        return stored, f"the checkpoint's dtype, {name}"
    fast = [flag for flag in FAST_CPU_FLAGS[stored] if flag in flags]
    if fast:
        return stored, f"the checkpoint's dtype, {name}: this CPU has {fast[0]}"
    return torch.float32, (f"the checkpoint is {name}, but this CPU lists none of {', '.join(FAST_CPU_FLAGS[stored])} "
                           f"(/proc/cpuinfo, {CPU_FLAGS.name}), so its {name} products are slow: {name} weights, "
                           f"float32 math (weights stay {name} in memory, multiplied in float32); "
                           f"compute_dtype (--compute-dtype) {name} keeps {name} math")


def resolve_compute_dtype(option: str | torch.dtype | None, stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to build the model in: `option`, or for auto `choose`'s pick; the INFO log says which and why."""
    asked = parse_compute_dtype(option)
    if asked is not None:
        log.info("compute dtype: %s (asked for; the checkpoint is %s)", str(asked).removeprefix("torch."),
                 str(stored).removeprefix("torch."))
        return asked
    dtype, why = choose(stored, device, cpu_flags())
    log.info("compute dtype: %s (auto: %s)", str(dtype).removeprefix("torch."), why)
    return dtype
