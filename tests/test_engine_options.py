"""EngineOptions: the engine's options as one value, checked once, and the batch policy as its method."""

from __future__ import annotations

import pytest
import torch

from shardstream import AutoModel, EngineOptions
from shardstream.errors import InvalidOption
from shardstream.stream.pieces import BATCH_PIECE_BYTES
from shardstream.stream import residency
from shardstream.stream.residency import batch_auto_budget
from tiny_models import llama_store_with_tokenizer

TOLERANCE = 1e-5   # float32 sums in another order


@pytest.mark.parametrize("fields, message", [
    (dict(max_resident_memory=-1), "max_resident_memory must be 'auto', None"),
    (dict(max_host_memory="2GB"), "max_host_memory must be 'auto', None"),
    (dict(experts="lazy"), "experts must be one of with_block, on_demand, not 'lazy'"),
    (dict(max_expert_memory=1 << 20), "max_expert_memory applies only with experts='on_demand'"),
    (dict(prefetch_depth=0), "prefetch_depth must be 'auto' or a number of pieces >= 1"),
    (dict(piece_bytes=0), "piece_bytes must be None or a number of bytes >= 1"),
    (dict(max_seq_len=0), "max_seq_len must be at least 1"),
    (dict(compute_dtype="int8"), "compute_dtype"),
])
def test_a_bad_option_is_refused_when_the_value_is_made(fields, message):
    with pytest.raises(InvalidOption, match=message):
        EngineOptions(**fields)


def test_for_batch_leaves_room_for_the_kv_caches_and_keeps_what_was_given(monkeypatch):
    # the memory available, pinned: read twice from the machine it moves between the reads
    monkeypatch.setattr(residency, "available_memory", lambda: (8 << 30, False))
    one = EngineOptions(experts="on_demand")
    assert one.for_batch(1, "cpu") is one
    batch = one.for_batch(8, "cpu")
    share = batch_auto_budget("cpu")
    assert (batch.max_resident_memory, batch.max_expert_memory, batch.piece_bytes) == (share, share, BATCH_PIECE_BYTES)
    given = EngineOptions(max_resident_memory=0, piece_bytes=1 << 20).for_batch(8, "cpu")
    assert (given.max_resident_memory, given.max_expert_memory, given.piece_bytes) == (0, "auto", 1 << 20)
    with pytest.raises(Exception):
        batch.piece_bytes = 1   # a value: frozen
    with pytest.raises(InvalidOption, match="batch_size must be at least 1, not 0"):
        one.for_batch(0, "cpu")


def test_from_pretrained_takes_the_value_or_the_options_one_by_one_not_both(tmp_path):
    store, reference, _ = llama_store_with_tokenizer(tmp_path)
    ids = torch.tensor([[3, 5, 7, 9]])
    options = EngineOptions(max_resident_memory=0, prefetching=False, compute_dtype="float32")
    with AutoModel.from_pretrained(store, options=options) as by_value:
        assert by_value.options == options and by_value.resident_blocks == []
        got = by_value(ids).logits
    with AutoModel.from_pretrained(store, max_resident_memory=0, prefetching=False, compute_dtype="float32") as one_by_one:
        assert one_by_one.options == options and torch.equal(one_by_one(ids).logits, got)
    with torch.no_grad():   # a few rows' products are W @ xᵀ (stream/linear.py): within rounding of MKL's x @ Wᵀ
        assert (reference(ids).logits - got).abs().max().item() <= TOLERANCE
    with pytest.raises(InvalidOption, match="as `options` or one by one, not both"):
        AutoModel.from_pretrained(store, options=options, max_resident_memory=None)
