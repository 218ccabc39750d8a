"""The engine's pass allocator (serving/pass_memory.py): within a pass, large blocks freed are
reused by later allocations; at the end of the pass they go back to the system; outside passes
nothing is kept. Each check runs in a fresh process, since the allocator is installed process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardstream.native import find_compiler

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler to build the allocator")


def _run(code: str, **env: str) -> dict:
    """Run `code` (which prints one JSON line last) in a fresh interpreter."""
    run = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r})\n{code}"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


BLOCKS = """
import json, re
from pathlib import Path
import torch
from shardstream.serving import pass_memory

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) >> 10

assert pass_memory.install()
out = {}
with pass_memory.reusing():
    first = torch.ones(1 << 20)                       # 4 MiB
    address = first.data_ptr()
    del first
    second = torch.empty(1 << 20)
    out["same_block_in_a_pass"] = second.data_ptr() == address
    out["reused_in_a_pass"] = pass_memory.reused_blocks()
    del second
    before = rss()
    big = torch.ones(64 << 18)                        # 64 MiB, kept when freed
    del big
    out["kept_mib"] = rss() - before
out["after_pass_mib"] = rss() - before
third = torch.ones(1 << 20)
address = third.data_ptr()
del third
fourth = torch.empty(1 << 20)
out["reused_outside"] = pass_memory.reused_blocks() - out["reused_in_a_pass"]
gelu = torch.nn.functional.gelu(torch.randn(1 << 21))  # a kernel that frees raw allocations through us
out["gelu_finite"] = bool(torch.isfinite(gelu).all())
print(json.dumps(out))
"""


@needs_compiler
def test_a_pass_reuses_its_large_blocks_and_gives_them_back_when_it_ends(tmp_path):
    out = _run(BLOCKS, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert out["same_block_in_a_pass"] and out["reused_in_a_pass"] == 1
    assert out["kept_mib"] >= 60, out          # the freed 64 MiB stayed, for the rest of the pass
    assert out["after_pass_mib"] <= 4, out     # and went back when it ended
    assert out["reused_outside"] == 0, out     # outside a pass, freed memory is freed
    assert out["gelu_finite"]
    assert list((tmp_path / "cache" / "shardstream").glob("pass_memory-*.so"))


ENGINE = """
import json, logging, io, torch
from tiny_models import tiny_model
from shardstream.serving import pass_memory
from shardstream.serving.batching import BatchEngine
from shardstream.serving.protocol import SamplingParams
stream = io.StringIO()
logging.basicConfig(stream=stream, level=logging.INFO)
model = tiny_model("llama")
prompts = [[5 + i, 9, 7 + i, 3] for i in range(4)]
with BatchEngine(model, eos_token_ids=set(), pad_token_id=0, max_batch_size=4) as engine:
    sequences = [engine.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    tokens = [[event.token for event in s] for s in sequences]
print(json.dumps({"tokens": tokens, "installed": pass_memory._installed is not None,
                  "log": [line for line in stream.getvalue().splitlines() if "pass memory" in line]}))
"""


@needs_compiler
def test_the_engine_gives_the_same_tokens_without_a_compiler(tmp_path):
    built = _run(ENGINE, XDG_CACHE_HOME=str(tmp_path / "a"))
    missing = _run(ENGINE, XDG_CACHE_HOME=str(tmp_path / "b"), CXX=str(tmp_path / "no-such-compiler"))
    switched_off = _run(ENGINE, XDG_CACHE_HOME=str(tmp_path / "c"), SHARDSTREAM_PASS_MEMORY="0")
    (tmp_path / "a-file").write_text("")   # the cache folder cannot be made under it
    unwritable = _run(ENGINE, XDG_CACHE_HOME=str(tmp_path / "a-file"))
    assert built["installed"] and not missing["installed"] and not switched_off["installed"]
    assert built["tokens"] == missing["tokens"] == switched_off["tokens"] == unwritable["tokens"]
    assert any("building pass_memory.cpp failed" in line for line in missing["log"]), missing["log"]
    assert any("SHARDSTREAM_PASS_MEMORY=0" in line for line in switched_off["log"]), switched_off["log"]
    assert not unwritable["installed"]
    assert any("cannot write to" in line for line in unwritable["log"]), unwritable["log"]


STREAMING = """
import json, os, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from tiny_models import tiny_config
from shardstream import AutoModel
from shardstream.convert import convert
from shardstream.serving import pass_memory
folder = Path(os.environ["FOLDER"])
torch.manual_seed(0)
config = tiny_config("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=3, max_position_embeddings=512)
reference = AutoModelForCausalLM.from_config(config).eval()
reference.save_pretrained(folder / "ckpt")
convert(folder / "ckpt", folder / "store", progress=False)
model = AutoModel.from_pretrained(folder / "store")
ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(1))   # 1.6 MiB MLP temporaries
with torch.no_grad():
    logits = model(ids).logits
    expected = reference(ids).logits
out = {"installed": pass_memory._installed is not None, "reused": pass_memory.reused_blocks(),
       "max_diff": (logits - expected).abs().max().item()}

def fail(module, args):
    raise RuntimeError("a pass that fails inside")

hook = model.model.model.layers[1].register_forward_pre_hook(fail)
try:
    model(ids)
except RuntimeError as error:
    out["error"] = str(error)
hook.remove()
before = pass_memory.reused_blocks()
first = torch.ones(1 << 20)
del first
second = torch.empty(1 << 20)
out["reused_after_the_failed_pass"] = pass_memory.reused_blocks() - before
print(json.dumps(out))
"""


@needs_compiler
def test_a_streaming_model_runs_its_passes_on_the_allocator_and_a_failed_pass_ends(tmp_path):
    """`AutoModel.from_pretrained` on the CPU, called directly (no batch engine): a prefill's large temporaries
    are reused within its pass, the logits are transformers' own, and a pass that raises still ends (nothing
    is kept outside it)."""
    out = _run(STREAMING, XDG_CACHE_HOME=str(tmp_path / "cache"), FOLDER=str(tmp_path))
    assert out["installed"] and out["reused"] > 0, out
    assert out["max_diff"] <= 1e-5, out
    assert out["error"] == "a pass that fails inside"
    assert out["reused_after_the_failed_pass"] == 0, out
