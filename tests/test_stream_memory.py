"""Pure streaming keeps peak RSS near the working set of its pieces in flight (stream/pieces.py),
for a model whose weights are 3x that bound: here, by default on a CPU, three 32 MiB pieces (two
16 MiB MLP Linears each), the memory two 48 MiB pieces of gate/up/down_proj would take
(StreamingModel._read_ahead); with a batch engine's piece size, two 16 MiB Linears.

Measured in a fresh subprocess (VmHWM, reset after loading, since a child inherits the peak of
the parent that forked it): after loading the resident parts: the growth of RSS while
generating must stay within the pieces in flight (one computing, the rest read ahead) plus a fixed
allowance for KV cache, activations and allocator slack. The page cache is not part of RSS; with
O_DIRECT the pieces' buffers are, and they are reused (one per piece in flight, and two small ones
for the blocks' norms), so the same bound holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.stream.pieces import BATCH_PIECE_BYTES

LAYERS, HIDDEN, INTERMEDIATE = 9, 1024, 4096
SLACK = 40 * 2**20  # KV cache, activations, allocator and thread overhead

PROBE = textwrap.dedent(r"""
    import json, re, sys
    import psutil, torch
    from shardstream import AutoModel
    model = AutoModel.from_pretrained(sys.argv[1], max_resident_memory=0, piece_bytes=json.loads(sys.argv[2]))
    baseline = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM), inherited from the forking parent
        f.write("5")
    ids = torch.arange(3, 19).unsqueeze(0)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1]) * 1024
    blocks = model.report().block_bytes
    piece = max(p.nbytes for ps in model.pieces.values() for p in ps)
    print(json.dumps({"baseline": baseline, "peak": peak, "block": max(blocks), "piece": piece, "blocks": len(blocks),
                      "passes": model.profile.total.passes, "direct": model.reading == "direct",
                      "working_set": model.stream_working_set}))
""")


# blocks mapped from the page cache, or read with O_DIRECT; the default pieces (3 in flight), or a batch engine's (2)
@pytest.mark.parametrize(("direct_io", "piece_bytes", "linears", "in_flight"),
                         [("off", None, 2, 3), ("on", None, 2, 3), ("on", BATCH_PIECE_BYTES, 1, 2)])
def test_peak_rss_stays_within_the_pieces_in_flight(tmp_path, direct_io, piece_bytes, linears, in_flight):
    config = AutoConfig.for_model(
        "llama", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="200MB")
    del model
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)

    run = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "store"), json.dumps(piece_bytes)],
                         capture_output=True, text=True,
                         timeout=300, env={**os.environ, "SHARDSTREAM_DIRECT_IO": direct_io})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["piece"] == linears * HIDDEN * INTERMEDIATE * 4   # the largest piece: fp32 MLP Linears
    assert in_flight * result["piece"] <= result["working_set"] < (in_flight + 1) * result["piece"]   # and two small ones
    bound = result["working_set"] + SLACK
    weights = result["blocks"] * result["block"]
    assert weights >= 3 * bound
    assert result["direct"] == (direct_io == "on")
    assert result["passes"] == 3 * LAYERS  # really streamed: every block, every token
    assert result["peak"] - result["baseline"] <= bound, result
