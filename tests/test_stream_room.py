"""Memory a model needs at once: converted pages not held twice, and a model that cannot fit refused in one
sentence before its first pass instead of killed by the kernel in the middle of one."""

from __future__ import annotations

import mmap
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardstream.convert import convert
from shardstream.errors import ShardstreamError
from shardstream.front.generate_cli import generate_command
from shardstream.stream.mapped import release_unviewed
from tiny_models import char_tokenizer, save_checkpoint

from test_serving_serve_memory import MEMCAP, _memcap_missing

PAGE = mmap.PAGESIZE
SHARDSTREAM = warm_python.SCRIPT   # the console script


def _rss_pages(mapping: mmap.mmap) -> int:
    """Pages of `mapping` that this process has mapped now (its lines in /proc/self/smaps)."""
    import numpy as np

    start = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^{start:x}-", line):
            rss = next(l for l in lines[i + 1:] if l.startswith("Rss:"))
            return int(rss.split()[1]) * 1024 // PAGE
    raise AssertionError("mapping not found in smaps")


def test_pages_no_tensor_views_are_released_and_read_back_when_touched(tmp_path):
    data = bytes(range(256)) * (16 * PAGE // 256)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), len(data), access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    whole[::PAGE].sum()   # every page mapped, as a resident part's are once read
    del whole
    viewed = torch.frombuffer(mapping, dtype=torch.uint8, count=int(3.7 * PAGE), offset=int(4.5 * PAGE))
    assert _rss_pages(mapping) == 16

    released = release_unviewed([mapping], [viewed, torch.zeros(3)])

    assert released == (4 + 7) * PAGE   # pages 0-3 and 9-15; pages 4-8 hold part of the view
    assert _rss_pages(mapping) == 5
    assert bytes(viewed[:16]) == data[int(4.5 * PAGE):int(4.5 * PAGE) + 16]
    assert mapping[:PAGE] == data[:PAGE] and mapping[-PAGE:] == data[-PAGE:]   # read back from the file


def _store_pages_after_load(store: Path, **options) -> int:
    """Bytes of the store's files mapped in a process that loaded it (its mappings' Rss in /proc/self/smaps)."""
    script = ("import re, pathlib, sys; from shardstream import AutoModel; "
              f"m = AutoModel.from_pretrained(sys.argv[1], **{options!r}); "
              "blocks = re.split(r'\\n(?=[0-9a-f]+-[0-9a-f]+ )', pathlib.Path('/proc/self/smaps').read_text()); "
              "print(sum(int(re.search(r'\\nRss:\\s+(\\d+)', b).group(1)) for b in blocks "
              "if b.split('\\n', 1)[0].rstrip().endswith('.safetensors') and sys.argv[1] in b.split('\\n', 1)[0]))")
    run = subprocess.run([sys.executable, "-c", script, str(store.resolve())], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split()[-1]) * 1024


def test_resident_moe_blocks_are_not_held_as_file_pages_beside_their_stacked_experts(tmp_path):
    """transformers stacks a Mixtral block's experts into one tensor: the checkpoint's pages are copied, and
    used to stay mapped beside the copy (a 2-layer Mixtral-8x7B shape: 5.9 GB of pages beside 5.6 GB)."""
    config = AutoConfig.for_model("mixtral", hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                  num_experts_per_tok=2, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    experts = 2 * 8 * 3 * 256 * 1024 * 4   # 50 MB of stacked experts

    mapped = _store_pages_after_load(tmp_path / "store", max_resident_memory=None)

    assert mapped < experts / 4, f"{mapped >> 20} MiB of the store still mapped"


needs_memcap = pytest.mark.skipif(_memcap_missing() is not None, reason=_memcap_missing() or "")


@needs_memcap
def test_a_model_whose_piece_cannot_fit_the_cap_is_refused_in_one_sentence(tmp_path):
    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=131072, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "ckpt")
    char_tokenizer().save_pretrained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)   # one 134 MB matrix per MLP projection

    run = subprocess.run([str(MEMCAP), "360M", "--", SHARDSTREAM, "generate", str(tmp_path / "store"), "--prompt", "hi",
                          "--max-new-tokens", "2", "--no-progress"], capture_output=True, text=True, timeout=300)

    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert re.search(r"error: streaming \S+store needs 128 MiB at once \(model\.layers\.0\.mlp\.\w+_proj\), but the "
                     r"memory limit of its container \(cgroup\) leaves \d+ MiB once the resident parts are loaded; give "
                     r"it at least \d+ MiB more, or stream a 4-bit store", run.stderr), run.stderr[-2000:]


def test_experts_on_demand_from_the_command_line_reads_routed_experts(tmp_path, capsys):
    """`generate --experts on-demand` (the command's body, in this process): refused on a store whose experts
    are not placed apart, then, after `shard --experts`, the text of the experts read with their block, for
    one prompt and for a batch (where experts held between passes are budgeted as residency)."""
    save_checkpoint("mixtral", tmp_path / "ckpt")
    char_tokenizer().save_pretrained(tmp_path / "ckpt")
    store = tmp_path / "store"
    convert(tmp_path / "ckpt", store, progress=False)
    generate_command(str(store), prompt="hello", max_new_tokens=4, no_progress=True)
    plain = capsys.readouterr().out
    with pytest.raises(ShardstreamError, match="run `shardstream shard"):
        generate_command(str(store), prompt="hello", no_progress=True, experts="on-demand")
    warm_python.run([SHARDSTREAM, "shard", str(store), "--experts"], check=True, capture_output=True, timeout=240)
    generate_command(str(store), prompt="hello", max_new_tokens=4, no_progress=True, experts="on-demand")
    assert capsys.readouterr().out == plain
    for held in ("0", "64KB"):   # every routed expert read on every pass; a few kept
        generate_command(str(store), prompt="hello", max_new_tokens=4, no_progress=True, experts="on-demand",
                         max_expert_memory=held)
        assert capsys.readouterr().out == plain

    (tmp_path / "prompts.txt").write_text("hello\nthe cat sat\nhello\n")
    batches = {}
    for experts in ("with-block", "on-demand"):
        batches[experts] = tmp_path / f"{experts}.jsonl"
        generate_command(str(store), prompts_file=tmp_path / "prompts.txt", output=batches[experts], batch_size=3,
                         max_new_tokens=4, no_progress=True, experts=experts)
    assert batches["on-demand"].read_text() == batches["with-block"].read_text()


@needs_memcap
def test_experts_on_demand_run_a_block_whose_experts_do_not_fit_the_cap(tmp_path):
    """A Mixtral block of 400 MB of experts under a 600 MiB cap: read with its block it is refused in one
    sentence that says how to read its experts on demand (placing them apart first, until they are); read on
    demand its experts are read one at a time, with the tokens of the run without a cap."""
    config = AutoConfig.for_model("mixtral", hidden_size=256, intermediate_size=16384, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                  num_experts_per_tok=2, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "ckpt")
    char_tokenizer().save_pretrained(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)   # 8 experts of 50 MB in one block
    generate = [SHARDSTREAM, "generate", str(tmp_path / "store"), "--prompt", "hello world", "--max-new-tokens", "4",
                "--no-progress"]
    free = warm_python.run(generate, capture_output=True, text=True, timeout=300)
    with_block = subprocess.run([str(MEMCAP), "600M", "--", *generate], capture_output=True, text=True, timeout=300)
    warm_python.run([SHARDSTREAM, "shard", str(tmp_path / "store"), "--experts"], check=True, capture_output=True,
                    timeout=300)
    placed_with_block = subprocess.run([str(MEMCAP), "600M", "--", *generate], capture_output=True, text=True,
                                       timeout=300)
    on_demand = subprocess.run([str(MEMCAP), "600M", "--", *generate, "--experts", "on-demand"],
                               capture_output=True, text=True, timeout=300)

    assert free.returncode == 0, free.stderr[-2000:]
    assert with_block.returncode == 1 and "Traceback" not in with_block.stderr, with_block.stderr[-2000:]
    assert re.search(r"needs \d+ MiB at once \(model\.layers\.0\.mlp\.experts", with_block.stderr), with_block.stderr[-2000:]
    how = "(`experts='on_demand'`, `--experts on-demand`), or stream a 4-bit store"
    assert (f"more, place its experts apart (`shardstream shard {tmp_path / 'store'} --experts`) and read them on "
            f"demand {how}") in with_block.stderr, with_block.stderr[-2000:]
    assert placed_with_block.returncode == 1 and "Traceback" not in placed_with_block.stderr
    assert f"more, read its experts on demand, one at a time {how}" in placed_with_block.stderr, \
        placed_with_block.stderr[-2000:]
    assert on_demand.returncode == 0, on_demand.stderr[-2000:]
    assert on_demand.stdout == free.stdout
