"""Reading streamed blocks past the page cache (stream/direct.py), with O_DIRECT or read and dropped: same
logits as mapping, checksums still checked on the first read, quantized stores, nothing of the blocks
left in the page cache, and a clean fallback where the filesystem refuses O_DIRECT."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess

import pytest
import torch

from shardstream.convert import convert
from shardstream.errors import InvalidOption, StoreCorrupt
from shardstream.store import open_store
from shardstream import AutoModel
from shardstream.stream import direct, loader
from shardstream.stream.direct import block_reading, read_buffer
from shardstream.switches import DIRECT_IO
from tiny_models import save_checkpoint

IDS = torch.tensor([[5, 9, 2, 7, 11, 3]])


def build(folder, compression=None):
    save_checkpoint("llama", folder / "ckpt")
    convert(folder / "ckpt", folder / "store", compression=compression, progress=False)
    return folder / "store"


def run(store, mode, monkeypatch):
    """Logits of a prompt and 3 greedy tokens with pure streaming, and the model's report (how it read)."""
    monkeypatch.setenv(DIRECT_IO.name, mode)
    model = AutoModel.from_pretrained(store, max_resident_memory=0)
    try:
        logits = model(IDS).logits
        out = model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, do_sample=False, pad_token_id=0)
        return logits, out, model.report()
    finally:
        model.close()


@pytest.mark.parametrize("mode, reading", [("on", "direct"), ("dropped", "dropped")])
@pytest.mark.parametrize("compression", [None, "4bit", "8bit"])
def test_reads_past_the_cache_give_the_same_logits_as_mapping(tmp_path, monkeypatch, compression, mode, reading):
    store = build(tmp_path, compression)
    mapped_logits, mapped_out, mapped = run(store, "off", monkeypatch)
    got_logits, got_out, report = run(store, mode, monkeypatch)
    assert mapped.reading == "mapped" and report.reading == reading  # ext4 (or any disk filesystem) takes O_DIRECT
    # every block read went into one of two reused buffers (and was dequantized into one of two more)
    assert 1 <= report.read_buffers <= (4 if compression else 2)
    assert torch.equal(mapped_logits, got_logits)
    assert torch.equal(mapped_out, got_out)


def _cached_pages(path) -> int:
    """Pages of the file in the page cache (mincore on a private mapping of it, never written)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    anchor = ctypes.c_char.from_buffer(mapping)
    status = ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size),
                                                       vector)
    del anchor
    mapping.close()
    assert status == 0, os.strerror(ctypes.get_errno())
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize("mode", ["dropped", "on"])
def test_blocks_read_past_the_cache_leave_no_pages_there(tmp_path, monkeypatch, mode):
    """Read through the page cache and dropped, or read with O_DIRECT, a streamed block's file is not left
    in the page cache (under a cap that counts the cache, nothing to reclaim); mapped, it all is."""
    store = build(tmp_path)
    files = [store / f for p, rec in open_store(store).manifest.parts.items() if p.startswith("mid/") for f in rec.files]
    for mode_, left in (("off", True), (mode, False)):
        for path in files:   # start cold
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        run(store, mode_, monkeypatch)
        cached = sum(_cached_pages(path) for path in files)
        total = sum(-(-os.path.getsize(path) // mmap.PAGESIZE) for path in files)
        assert (cached == total) if left else cached <= len(files), (mode_, cached, total)


def test_direct_reads_reuse_a_few_buffers(tmp_path, monkeypatch):
    store = build(tmp_path)
    _, _, report = run(store, "on", monkeypatch)
    blocks = open_store(store).num_layers
    assert blocks > 2
    assert report.read_buffers == 2  # one block computing + one read ahead, for every pass over every block


def test_corrupt_block_fails_its_checksum_on_the_first_direct_read(tmp_path, monkeypatch):
    store = build(tmp_path)
    name = open_store(store).manifest.parts["mid/1"].files[0]
    with open(store / name, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setenv(DIRECT_IO.name, "on")
    model = AutoModel.from_pretrained(store, max_resident_memory=0)
    try:
        with pytest.raises(StoreCorrupt, match=r"fails its checksum; re-run `shardstream convert`"):
            model(IDS)
    finally:
        model.close()


@pytest.fixture
def ramfs(tmp_path):
    """A real filesystem that refuses O_DIRECT (ramfs); needs root to mount."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting ramfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_falls_back_to_mapping_where_o_direct_is_refused(tmp_path, ramfs, monkeypatch):
    reference = build(tmp_path)
    store = shutil.copytree(reference, ramfs / "store")
    expected_logits, expected_out, _ = run(reference, "off", monkeypatch)
    logits, out, report = run(store, "on", monkeypatch)
    assert report.reading == "mapped"  # switched to mapping at the first refusal, and stayed there
    assert torch.equal(logits, expected_logits)
    assert torch.equal(out, expected_out)


def test_auto_keeps_the_page_cache_when_the_blocks_fit(tmp_path, monkeypatch):
    store = open_store(build(tmp_path))
    monkeypatch.delenv(DIRECT_IO.name, raising=False)
    assert block_reading(store) == "mapped"  # a tiny model: a warm page cache beats reading it again
    # blocks larger than the memory: O_DIRECT into huge pages, else read and dropped on a CPU, O_DIRECT
    # where copies cost more
    monkeypatch.setattr(direct, "huge_pages", lambda: True)
    assert block_reading(store, memory=0) == "direct"
    monkeypatch.setattr(direct, "huge_pages", lambda: False)
    assert block_reading(store, memory=0) == "dropped" and block_reading(store, memory=0, copy_free=True) == "direct"
    assert [block_reading(store, mode, memory=0) for mode in ("on", "off", "dropped")] == ["direct", "mapped", "dropped"]


@pytest.mark.skipif(not direct.huge_pages(), reason="the kernel gives no transparent huge pages here")
def test_read_buffers_get_huge_pages():
    """O_DIRECT requests into 4 KiB pages are cut at the queue's max_segments pages (1 MiB on a virtio
    disk); the read buffers are private mappings that ask for huge pages (shared ones never get them)."""
    buffer = read_buffer(8 << 20)
    buffer.write(bytes(len(buffer)))   # fault every page in
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    huge_kib, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split()[0]:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                huge_kib = int(line.split()[1])
    assert huge_kib >= 2048, "the read buffer got no huge page"


def test_unknown_mode_is_refused_with_the_variable_named(tmp_path, monkeypatch):
    store = open_store(build(tmp_path))
    monkeypatch.setenv(DIRECT_IO.name, "sometimes")
    with pytest.raises(InvalidOption, match=r"SHARDSTREAM_DIRECT_IO must be one of auto, on, off, dropped, not 'sometimes'"):
        block_reading(store)


@pytest.mark.parametrize("room, mapped", [(1.1, False), (4.0, True)])
def test_auto_maps_streamed_blocks_only_where_every_block_and_the_head_fit_at_once(tmp_path, monkeypatch, room, mapped):
    """Mapped, the resident blocks, the head and the streamed blocks are all page cache. Memory for the blocks'
    files alone (`room` = 1.1 times them) once chose mapping, and under a cap the streamed blocks were then
    evicted and read again every pass; they are read past the cache unless all of it fits in auto's share."""
    store = build(tmp_path)
    manifest = open_store(store).manifest
    blocks = sum(manifest.files[f].size for part, record in manifest.parts.items() if part.startswith("mid/")
                 for f in record.files)
    for module in (direct, loader):
        monkeypatch.setattr(module, "available_memory", lambda: (int(room * blocks), True))
    monkeypatch.setenv(DIRECT_IO.name, "auto")
    model = AutoModel.from_pretrained(store, max_resident_memory=blocks * 3 // 4)   # some blocks resident, some streamed
    try:
        assert model.resident_blocks and len(model.resident_blocks) < len(model.block_modules)
        assert (model.report().reading == "mapped") == mapped
        assert model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=2, do_sample=False,
                              pad_token_id=0).shape[-1] == IDS.shape[-1] + 2
    finally:
        model.close()
