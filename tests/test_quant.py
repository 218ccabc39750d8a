"""Blockwise NF4 / 8-bit quantization: error bounds, exact values, bitsandbytes layout, bad meta."""

import json

import pytest
import torch
import torch.nn.functional as F

from shardstream import quant
from shardstream.errors import InvalidOption, StoreCorrupt

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True, params=["torch", "bitsandbytes"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run every test on both paths: pure torch, and bitsandbytes' kernels (quantize and dequantize) if they work here."""
    if request.param == "torch":
        monkeypatch.setattr(quant, "_bnb_kernels", lambda: None)
        monkeypatch.setattr(quant, "_bnb_library", lambda: None)
    elif quant._bnb_kernels() is None or quant._bnb_library() is None:
        pytest.skip("bitsandbytes is not installed or its kernels do not match on this machine")
    else:
        monkeypatch.setattr(quant, "_QUANTIZE_WITH_BNB", True)
    return request.param


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)


def round_trip(x: torch.Tensor, method: str, blocksize: int | None = None) -> torch.Tensor:
    q = quant.quantize(x, method, blocksize)
    return quant.dequantize(q.data, q.absmax, q.meta)


def per_block(values: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Flattened values as rows of one block each; the last row zero-padded."""
    flat = values.reshape(-1).float()
    return F.pad(flat, (0, -flat.numel() % blocksize)).view(-1, blocksize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("shape", [(37, 300), (3, 5, 7), (1, 1)])
def test_round_trip_error_within_block_bound(backend: str, method: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = randn(*shape, dtype=dtype)
    y = round_trip(x, method)
    assert y.shape == x.shape and y.dtype == x.dtype
    if backend == "bitsandbytes" and method == "8bit":
        # bitsandbytes' approximate code search can land a hair beyond the nearest-code bound
        # (seen 0.007046 vs 0.0070315 of absmax); its own output is what that path promises.
        bnb = pytest.importorskip("bitsandbytes.functional")
        codes, state = bnb.quantize_blockwise(x.reshape(-1), blocksize=256)
        assert torch.equal(quant.quantize(x, method).data, codes.view(-1))
        return
    blocksize = quant.DEFAULT_BLOCKSIZE[method]
    block_error = per_block(y.float() - x.float(), blocksize).abs().amax(dim=1)
    block_absmax = per_block(x, blocksize).abs().amax(dim=1)
    assert bool((block_error <= block_absmax * quant.relative_error_bound(method, dtype)).all())
    assert float((y.float() - x.float()).abs().max()) <= quant.max_abs_error_bound(x, method)


@pytest.mark.parametrize(("method", "low", "high"), [("4bit", 0.15, 0.16), ("8bit", 0.0069, 0.0071)])
def test_relative_bound_is_the_largest_half_gap(method: str, low: float, high: float) -> None:
    # NF4: (-0.696 - -1) / 2 = 0.1519; 8-bit: the map ends at -0.993, 0.0070 short of -1.
    assert low < quant.relative_error_bound(method, torch.float32) < high


@pytest.mark.parametrize("method", quant.BLOCKWISE)
def test_bound_is_reached_on_random_weights(method: str) -> None:
    # Guards against a bound so loose that the round-trip test above could never fail.
    x = randn(256, 256)
    error = (round_trip(x, method) - x).abs().max()
    assert float(error) > 0.5 * quant.max_abs_error_bound(x, method)


@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_block_max_are_exact(method: str, dtype: torch.dtype) -> None:
    blocksize = quant.DEFAULT_BLOCKSIZE[method]
    x = randn(3, blocksize, dtype=dtype)
    x[0] = 0
    x[1, 5] = x[1].abs().max() * 2  # a positive block max
    y = round_trip(x, method)
    assert bool((y[0] == 0).all())
    assert y[1, 5] == x[1, 5]
    assert bool((y == 0)[x == 0].all())


def test_negative_block_max_is_exact_in_nf4() -> None:
    x = randn(64)
    x[9] = -1.0
    assert round_trip(x, "4bit")[9] == -1.0


@pytest.mark.parametrize("method", quant.BLOCKWISE)
def test_code_values_times_power_of_two_round_trip_exactly(backend: str, method: str) -> None:
    code = quant.NF4_CODE if method == "4bit" else quant.dynamic_map()
    x = (code * 8).repeat(4)  # every block holds every code and +8, so absmax is 8
    q = quant.quantize(x, method, blocksize=code.numel())
    if backend == "bitsandbytes" and method == "8bit":  # approximate search: their own bytes
        codes, _ = pytest.importorskip("bitsandbytes.functional").quantize_blockwise(x, blocksize=code.numel())
        assert torch.equal(q.data, codes.view(-1))
        return
    assert torch.equal(quant.dequantize(q.data, q.absmax, q.meta), x)


def test_nf4_packs_first_value_in_high_nibble() -> None:
    x = torch.zeros(64)
    x[0], x[1], x[2] = 1.0, -1.0, 0.5  # codes 15, 0, 12 (0.5 is nearest 0.5626)
    q = quant.quantize(x, "4bit")
    assert q.data[:2].tolist() == [0xF0, 0xC7]  # zeros are code 7
    assert q.data.numel() == 32


def test_nf4_odd_numel_pads_last_nibble_with_the_zero_code() -> None:
    q = quant.quantize(torch.tensor([[1.0, -1.0, 1.0]]), "4bit")
    assert q.data.tolist() == [0xF0, 0xF7]
    assert q.absmax.tolist() == [1.0]


@pytest.mark.parametrize(("method", "nbytes"), [("4bit", 53), ("8bit", 105)])
def test_partial_last_block_gets_its_own_absmax(method: str, nbytes: int) -> None:
    x = torch.ones(105)
    x[100:] = 4.0
    q = quant.quantize(x, method, blocksize=10)
    assert q.data.numel() == nbytes
    assert q.absmax.tolist() == [1.0] * 10 + [4.0]
    assert torch.equal(quant.dequantize(q.data, q.absmax, q.meta), x)


def test_meta_is_json_and_records_shape_and_dtype() -> None:
    q = quant.quantize(randn(4, 64, dtype=torch.bfloat16), "8bit", blocksize=128)
    assert json.loads(json.dumps(q.meta)) == {"method": "8bit", "blocksize": 128, "shape": [4, 64], "dtype": "bfloat16"}
    assert q.data.dtype == torch.uint8 and q.absmax.dtype == torch.float32


def test_default_blocksizes_follow_bitsandbytes() -> None:
    x = randn(8, 256)
    assert quant.quantize(x, "4bit").absmax.numel() == 32
    assert quant.quantize(x, "8bit").absmax.numel() == 8


def test_non_contiguous_input_matches_contiguous() -> None:
    x = randn(64, 96)
    a, b = quant.quantize(x.t(), "4bit"), quant.quantize(x.t().contiguous(), "4bit")
    assert torch.equal(a.data, b.data) and torch.equal(a.absmax, b.absmax)


@pytest.mark.parametrize("method", quant.BLOCKWISE)
def test_dequantize_reads_bytes_at_an_odd_offset(method: str) -> None:
    # A store may hand over a slice of a larger buffer; 2-byte words need not be aligned there.
    q = quant.quantize(randn(10, 64), method)
    buffer = torch.zeros(q.data.numel() + 1, dtype=torch.uint8)
    buffer[1:] = q.data
    assert torch.equal(quant.dequantize(buffer[1:], q.absmax, q.meta), quant.dequantize(q.data, q.absmax, q.meta))


@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_into_a_given_buffer_writes_every_value_there(method: str, dtype: torch.dtype) -> None:
    # A streaming reader dequantizes into a reused buffer: stale values must all be overwritten.
    q = quant.quantize(randn(6, 130, dtype=dtype), method)
    out = torch.full((6 * 130,), float("nan"), dtype=dtype)
    assert quant.dequantized_nbytes(q.meta) == out.numel() * out.element_size()
    got = quant.dequantize(q.data, q.absmax, q.meta, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (6, 130)
    assert torch.equal(got, quant.dequantize(q.data, q.absmax, q.meta))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        quant.dequantize(q.data, q.absmax, q.meta, torch.empty(6 * 130, dtype=torch.float64))


@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 130), (3, 64), (7,)])
def test_elementwise_dequantization_a_gpu_runs_gives_the_same_values(method: str, dtype: torch.dtype, shape) -> None:
    # On a GPU a block is copied as its codes and dequantized there by these elementwise kernels (loader.to_device);
    # run here on the CPU, they must give the very values the host's dequantization gives (odd sizes, last block short).
    q = quant.quantize(randn(*shape, dtype=dtype), method)
    values = quant._dequantize_elementwise(q.data, q.absmax, method, q.meta["blocksize"], torch.Size(shape).numel())
    assert values.dtype == torch.float32
    assert torch.equal(values.to(dtype).view(shape), quant.dequantize(q.data, q.absmax, q.meta))


def test_empty_tensor_round_trips() -> None:
    assert round_trip(torch.zeros(0, 8), "4bit").shape == (0, 8)


def test_large_tensor_spanning_several_chunks_matches_per_block_reference() -> None:
    x = randn(3 * quant._CHUNK_ELEMENTS + 70)
    q = quant.quantize(x, "4bit")
    blocks = per_block(x, 64)
    assert torch.equal(q.absmax, blocks.abs().amax(dim=1))
    y = quant.dequantize(q.data, q.absmax, q.meta)
    assert float((y - x).abs().max()) <= quant.max_abs_error_bound(x, "4bit")


@pytest.mark.parametrize(
    ("name", "tensor", "expected"),
    [
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64), True),
        ("model.embed_tokens.weight", torch.zeros(100, 64, dtype=torch.bfloat16), True),
        ("model.layers.0.self_attn.q_proj.bias", torch.zeros(4096), False),
        ("model.layers.0.input_layernorm.weight", torch.zeros(4096), False),
        ("model.layers.0.attn.q_norm.weight", torch.zeros(2, 64), False),
        ("model.layers.0.mlp.gate.weight", torch.zeros(4, 8), False),  # smaller than a block
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.float64), False),
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.int8), False),
    ],
)
def test_should_quantize(name: str, tensor: torch.Tensor, expected: bool) -> None:
    assert quant.should_quantize(name, tensor) is expected


def test_should_quantize_uses_the_method_blocksize() -> None:
    tensor = torch.zeros(8, 16)  # 128 values: a 4bit block fits, an 8bit block does not
    assert quant.should_quantize("w", tensor, "4bit") and not quant.should_quantize("w", tensor, "8bit")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("3bit",), "method"),
        (("4bit", 0), "blocksize"),
        (("4bit", 63), "blocksize"),
        (("8bit", True), "blocksize"),
    ],
)
def test_quantize_rejects_bad_options(args: tuple, match: str) -> None:
    with pytest.raises(InvalidOption, match=match):
        quant.quantize(torch.zeros(64), *args)


@pytest.mark.parametrize("tensor", [torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.float64)])
def test_quantize_rejects_other_dtypes(tensor: torch.Tensor) -> None:
    with pytest.raises(InvalidOption, match="dtype"):
        quant.quantize(tensor, "4bit")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_rejects_non_finite_values(bad: float) -> None:
    x = torch.zeros(200)
    x[150] = bad
    with pytest.raises(InvalidOption, match="NaN or infinite"):
        quant.quantize(x, "8bit")


@pytest.fixture
def stored() -> quant.QuantizedTensor:
    return quant.quantize(randn(4, 64), "4bit")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"method": "nf4"}, "'method'"),
        ({"blocksize": 0}, "'blocksize'"),
        ({"blocksize": "64"}, "'blocksize'"),
        ({"shape": [4, -64]}, "'shape'"),
        ({"shape": "4x64"}, "'shape'"),
        ({"dtype": "float64"}, "'dtype'"),
        ({"shape": [4, 65]}, "'data'"),
        ({"blocksize": 32}, "'absmax'"),
    ],
)
def test_dequantize_names_the_bad_meta_field(stored: quant.QuantizedTensor, change: dict, field: str) -> None:
    with pytest.raises(StoreCorrupt, match=field):
        quant.dequantize(stored.data, stored.absmax, {**stored.meta, **change})


def test_dequantize_names_a_missing_meta_field(stored: quant.QuantizedTensor) -> None:
    meta = dict(stored.meta)
    del meta["dtype"]
    with pytest.raises(StoreCorrupt, match="lacks field 'dtype'"):
        quant.dequantize(stored.data, stored.absmax, meta)


def test_dequantize_rejects_wrongly_typed_arrays(stored: quant.QuantizedTensor) -> None:
    with pytest.raises(StoreCorrupt, match="'data'"):
        quant.dequantize(stored.data.to(torch.int8), stored.absmax, stored.meta)
    with pytest.raises(StoreCorrupt, match="'absmax'"):
        quant.dequantize(stored.data, stored.absmax.half(), stored.meta)


# --- bitsandbytes agreement (runs where bitsandbytes is installed and works on this device) ---


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes.functional")


def test_code_tables_equal_bitsandbytes(bnb) -> None:
    assert torch.equal(quant.NF4_CODE, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(quant.dynamic_map(), bnb.create_dynamic_map())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [64 * 40, 1001])
def test_nf4_matches_bitsandbytes(bnb, dtype: torch.dtype, numel: int) -> None:
    x = randn(numel, dtype=dtype)
    ours = quant.quantize(x, "4bit")
    codes, state = bnb.quantize_4bit(x, quant_type="nf4", blocksize=64)
    assert torch.equal(ours.data, codes.view(-1))  # pure-torch bnb path: same nearest-code rule
    assert torch.equal(ours.absmax, state.absmax)
    assert torch.equal(quant.dequantize(ours.data, ours.absmax, ours.meta), bnb.dequantize_4bit(codes, state).view(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [256 * 40, 1001])
def test_8bit_matches_bitsandbytes_within_rounding(bnb, backend: str, dtype: torch.dtype, numel: int) -> None:
    x = randn(numel, dtype=dtype, seed=1)
    ours = quant.quantize(x, "8bit")
    codes, state = bnb.quantize_blockwise(x, blocksize=256)
    codes = codes.view(-1)
    assert torch.equal(ours.absmax, state.absmax)
    if backend == "bitsandbytes":  # quantized by their kernel: their bytes exactly
        assert torch.equal(ours.data, codes)
        return
    # bitsandbytes' CPU kernel finds the code by an approximate binary search, so it sometimes
    # lands a step or two off (near zero, where codes are dense); where the codes differ, ours is
    # never the farther one.
    differ = ours.data != codes
    assert int(differ.sum()) <= numel // 100
    scaled = per_block(x, 256) / state.absmax.unsqueeze(1)
    scaled = scaled.view(-1)[:numel][differ]
    table = quant.dynamic_map()
    assert bool(((scaled - table[ours.data[differ].long()]).abs() <= (scaled - table[codes[differ].long()]).abs() + 1e-7).all())
    # Reading their bytes gives exactly their values: the stored format is interchangeable.
    theirs = bnb.dequantize_blockwise(codes.view(x.shape), state)
    assert torch.equal(quant.dequantize(codes, state.absmax, ours.meta), theirs)


def nearest_codes(x: torch.Tensor, method: str, blocksize: int) -> torch.Tensor:
    """Reference: per block x * (1 / absmax), then the nearest code, ties to the lower one."""
    blocks = per_block(x, blocksize)
    scaled = (blocks * (1.0 / blocks.abs().amax(dim=1).clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1)
    return torch.bucketize(scaled.view(-1)[: x.numel()], quant._MIDPOINTS[method]).to(torch.uint8)


@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_picks_the_nearest_code_ties_low(backend: str, method: str, dtype: torch.dtype) -> None:
    if backend != "torch":
        pytest.skip("bitsandbytes' 8-bit search is approximate; its path is checked against its own output")
    mids, code = quant._MIDPOINTS[method], quant._CODES[method]
    edges = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), code])
    tiny = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -3e-39])
    x = torch.cat([edges, tiny, torch.ones(1), randn(3 * quant._CHUNK_ELEMENTS + 77, seed=3) * torch.rand(1).pow(6)])
    x = x.to(dtype)
    q = quant.quantize(x, method)
    expected = nearest_codes(x, method, quant.DEFAULT_BLOCKSIZE[method])
    if method == "4bit":
        expected = torch.cat([expected, expected.new_full((x.numel() % 2,), 7)])
        expected = (expected[0::2] << 4) | expected[1::2]
    assert torch.equal(q.data, expected)


@pytest.mark.parametrize("method", quant.BLOCKWISE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "blocksize"), [((40, 128), 64), ((37, 48), 64), ((9, 16), 32), ((5, 512), 256)])
def test_dequantize_rows_gives_the_rows_of_the_whole(method: str, dtype: torch.dtype, shape: tuple[int, int],
                                                      blocksize: int) -> None:
    """Rows looked up in the codes (a packed embedding) equal those rows of the dequantized matrix, whether the
    blocks fall on row boundaries or straddle them (the last block partial)."""
    packed = quant.quantize(torch.randn(*shape).to(dtype), method, blocksize)
    whole = quant.dequantize(packed.data, packed.absmax, packed.meta)
    rows = torch.tensor([shape[0] - 1, 0, 3, 3, 1])
    got = quant.dequantize_rows(packed, rows)
    assert got.dtype == dtype and torch.equal(got, whole[rows])
