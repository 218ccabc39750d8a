"""The batch engine admits sequences by `Shape.pass_bytes`, its estimate of a pass's temporaries: an
estimate under the real peak lets a batch outgrow the memory it was admitted for (under a cap: killed),
one far over it holds the batch back. Here the real peak of a prefill pass is measured for every family,
in a fresh process (the rise of its peak resident memory over the pass, with glibc mapping large
allocations on their own and handing freed memory back, and the pass reusing its large blocks
(`serving/pass_memory.py`), as the engine has it), and must stay within the estimate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardstream.native import find_compiler
from tiny_models import COMMON, CONFIGS

HIDDEN = 256          # wide enough that a pass's activations are mapped (>= 1 MiB), not drawn from the heap
ROWS, COLUMNS = 32, 32


def _config(family: str):
    """The family's tiny config, widened to HIDDEN with its own intermediate/hidden ratio, 2 layers."""
    from transformers import AutoConfig

    settings = {**COMMON, **CONFIGS[family]}
    model_type = settings.pop("model_type")
    scale = HIDDEN // settings.get("hidden_size", settings.get("n_embd"))
    for name in ("hidden_size", "n_embd", "intermediate_size", "head_dim"):
        if name in settings:
            settings[name] *= scale
    for name in ("num_hidden_layers", "n_layer"):
        if name in settings:
            settings[name] = 2
    return AutoConfig.for_model(model_type, **settings)


def _memory() -> tuple[int, int]:
    """(peak, current) resident bytes of this process."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status)[1]) << 10, int(re.search(r"VmRSS:\s+(\d+)", status)[1]) << 10


def _measure_all() -> None:
    """Print {family: [measured bytes, estimated bytes]}: the largest peak rise of two prefill passes
    (after one of the same shape, so one-time buffers are not counted), less the KV cache it reserved."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardstream.serving import pass_memory
    from shardstream.serving.admission import Shape, _libc, map_large_allocations
    from shardstream.serving.kvcache import reserved_bytes, reserved_cache

    map_large_allocations()
    pass_memory.install()   # as the engine does: where no compiler builds it, passes run without it
    results = {}
    for family in CONFIGS:
        torch.manual_seed(0)
        config = _config(family)
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(3, 120, (ROWS, COLUMNS))
        rises = []
        with torch.no_grad():
            for _ in range(3):
                _libc().malloc_trim(0)
                Path("/proc/self/clear_refs").write_text("5")   # the peak (VmHWM) restarts from now
                before = _memory()[1]
                cache = reserved_cache(COLUMNS)
                with pass_memory.reusing():
                    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                rises.append(_memory()[0] - before - reserved_bytes(cache))
                del cache
        estimate = Shape.of(config, torch.float32).pass_bytes(ROWS, COLUMNS, COLUMNS, 1)
        results[family] = [max(rises[1:]), estimate]
    results["reused"] = pass_memory.reused_blocks()
    print(json.dumps(results))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_pass_never_takes_more_than_admission_counts_for_it():
    tests = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tests)!r}); "
                          "import test_serving_admission as t; t._measure_all()"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "THP_MEM_ALLOC_ENABLE": "0"})   # huge pages would round the peak up
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    reused = results.pop("reused")
    assert reused > 0 or find_compiler() is None, "the passes did not run on the reusing allocator"
    assert set(results) == set(CONFIGS)
    over = {family: f"{measured / 2**20:.1f} MiB measured, {estimate / 2**20:.1f} MiB counted"
            for family, (measured, estimate) in results.items() if measured > estimate}
    assert not over, over
    # nor far over it: a batch would be held back for memory it never takes
    loose = {family: round(estimate / measured, 2) for family, (measured, estimate) in results.items()
             if estimate > 2.5 * measured}
    assert not loose, loose
