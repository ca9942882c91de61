"""FP8 block quantization. Legend: M rows, K columns, N weight rows, E groups, T row tiles."""

import dataclasses

import pytest
import torch

import mt_ops.fp8_quant_gluon as quant_gluon
from mt_ops.fp8_quant import (
    QUANT_CONFIG,
    Fp8Quantized,
    _launch_1x128_kernel_for_test,
    _launch_128x128,
    _launch_row_tiles,
    dequantize_1x128,
    dequantize_128x128,
    dequantize_tiles_transposed,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_dual_reference,
    quantize_1x128_reference,
    quantize_128x128,
    quantize_128x128_reference,
    row_tiles,
    row_tiles_reference,
    scale_to_float,
)

FORMATS = ["fp32", "e8m0"]


def _wide_range(num_rows, num_cols, seed=0):
    """Rows and columns spanning 12 orders of magnitude, with an all-zero row and column."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_cols, generator=gen)
    x = x * torch.logspace(-6, 6, num_cols)[None, :] * torch.logspace(-3, 3, num_rows)[:, None]
    if num_rows > 2 and num_cols > 2:
        x[2] = 0.0
        x[:, 1] = 0.0
    return x


def test_row_tiles_of_cpu_counts_name_a_negative_count_and_a_wrong_sum():
    with pytest.raises(ValueError, match=r"rows_per_group\[1\] is -3 .*\[12, -3, 1\]"):
        row_tiles(torch.tensor([12, -3, 1]), 10)
    with pytest.raises(ValueError, match=r"rows_per_group \(\[5, 1, 1\]\) sums to 7, not the 10"):
        row_tiles(torch.tensor([5, 1, 1]), 10)


def test_row_tiles_cover_every_row_once_and_restart_at_each_expert():
    counts = torch.tensor([0, 130, 3, 0, 300])
    tiles = row_tiles(counts, 433)
    used = tiles.group_T < 5
    assert tiles.num_tiles == 4 + 5  # ceil(433 / 128) + E slots
    lengths = (tiles.end_T - tiles.start_T)[used]
    assert int(lengths.sum()) == 433 and int(lengths.max()) <= 128
    starts = tiles.start_T[used].tolist()
    assert starts == [0, 128, 130, 133, 261, 389]  # every expert starts a new tile
    assert tiles.group_first_tile_G.tolist() == [0, 0, 2, 3, 3, 6]
    assert torch.all(tiles.start_T[~used] == 0) and torch.all(tiles.end_T[~used] == 0)


_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA])  # cpu: the kernel in the interpreter
def test_row_tiles_kernel_equals_the_eager_reference(device):
    # Empty groups first, last and in between; a group of exactly 128 rows; many programs
    # of 64 slots (3 groups) and of 16 (300 groups).
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 400, (300,), generator=gen)
    many[::7] = 0
    for counts in ([0, 130, 3, 0, 300], [128], [0], [5, 0, 0], [100_000, 0, 200_000], many):
        counts = torch.as_tensor(counts, device=device)
        num_rows = int(counts.sum())
        got = _launch_row_tiles(counts, num_rows)
        expected = row_tiles_reference(counts, num_rows)
        for name in ("start_T", "end_T", "group_T", "group_first_tile_G"):
            assert torch.equal(getattr(got, name), getattr(expected, name).int()), (counts, name)
        assert got.num_rows == num_rows


@pytest.mark.parametrize("scale_format", FORMATS)
def test_reference_scale_is_the_smallest_power_of_two_that_fits_448(scale_format):
    x = _wide_range(64, 300)
    q = quantize_1x128_reference(x, scale_format=scale_format)
    scale = scale_to_float(q.scale)
    amax = torch.nn.functional.pad(x.abs(), (0, 84)).view(64, 3, 128).amax(-1)
    nonzero = amax > 0
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))  # powers of two
    assert torch.all(amax[nonzero] / scale[nonzero] <= 448)
    assert torch.all(amax[nonzero] / (scale[nonzero] / 2) > 448)  # and the smallest
    assert torch.all(scale[~nonzero] == 1.0)
    assert torch.all(q.data[2].float() == 0.0)
    # Exact scaling: dequantized values are the fp8 rounding of x / scale, error <= 1/16.
    deq = dequantize_1x128(q)
    rel = (deq - x).abs() / x.abs().clamp_min(1e-30)
    big = x.abs() >= scale.repeat_interleave(128, 1)[:, :300] * 2**-6  # normal fp8 range
    assert float(rel[big].max()) <= 2**-4


def test_huge_values_quantize_without_nan():
    x = torch.tensor([[3.0e38, -3.0e38, 1.0, 0.0] * 40])
    q = quantize_1x128_reference(x)
    assert not torch.isnan(q.data.float()).any()
    assert float(q.data.float().abs().max()) <= 448


@pytest.mark.parametrize("trans_store", [False, True])  # the two transposed-store patterns
@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("shape", [(300, 200), (1, 5), (0, 128)])
def test_dual_kernel_matches_reference_scales_exactly_in_interpreter(
    shape, segmented, scale_format, trans_store, fp8_mostly_equal, monkeypatch
):
    monkeypatch.setitem(QUANT_CONFIG, "dual_trans_store", trans_store)
    x = _wide_range(*shape).bfloat16()
    tiles = None
    if segmented and shape[0] >= 133:
        tiles = row_tiles(torch.tensor([0, 130, 3, shape[0] - 133]), shape[0])
    rows, cols = _launch_1x128_kernel_for_test(x, tiles, scale_format)
    ref_rows, ref_cols = quantize_1x128_dual_reference(x, tiles=tiles, scale_format=scale_format)
    assert torch.equal(scale_to_float(rows.scale), scale_to_float(ref_rows.scale))
    assert torch.equal(scale_to_float(cols.scale), scale_to_float(ref_cols.scale))
    assert fp8_mostly_equal(rows.data, ref_rows.data)
    assert fp8_mostly_equal(cols.data, ref_cols.data)
    assert cols.data.shape == (cols.scale.shape[0], shape[1], 128)  # tile-major [T, K, 128]


def test_dual_kernel_gathers_and_weights_rows_as_a_permute_then_quantize(
    fp8_mostly_equal, scale_format="fp32"
):
    # 97 tokens gathered into 300 routed rows (repeats, a skipped token), each row scaled by
    # its weight: the kernel reads x once and writes what quantizing the gathered copy would.
    x = _wide_range(97, 200).float()  # fp32: the interpreter mis-rounds casts to bf16
    gen = torch.Generator().manual_seed(4)
    source_rows = torch.randint(0, 96, (300,), generator=gen)
    weights = torch.rand(300, generator=gen)
    tiles = row_tiles(torch.tensor([0, 130, 3, 167]), 300)
    for w in (None, weights):
        rows, cols = _launch_1x128_kernel_for_test(
            x, tiles, scale_format, source_rows=source_rows, row_weights=w
        )
        gathered = x[source_rows] if w is None else w[:, None] * x[source_rows]
        ref_rows, ref_cols = quantize_1x128_dual_reference(gathered, tiles=tiles)
        assert torch.equal(rows.scale, ref_rows.scale) and torch.equal(cols.scale, ref_cols.scale)
        assert fp8_mostly_equal(rows.data, ref_rows.data)
        assert fp8_mostly_equal(cols.data, ref_cols.data)
        # The reference takes the same options.
        opt_rows, opt_cols = quantize_1x128_dual_reference(
            x, tiles=tiles, source_rows=source_rows, row_weights=w
        )
        assert torch.equal(opt_rows.data.view(torch.uint8), ref_rows.data.view(torch.uint8))
        assert torch.equal(opt_cols.data.view(torch.uint8), ref_cols.data.view(torch.uint8))


def test_dual_quantization_rejects_bad_row_options():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="source_rows.*integer"):
        quantize_1x128_dual(x, source_rows=torch.zeros(3))
    with pytest.raises(ValueError, match=r"row_weights shape \(\(2,\)\).*\[3\]"):
        quantize_1x128_dual(x, source_rows=torch.tensor([0, 1, 1]), row_weights=torch.ones(2))
    with pytest.raises(ValueError, match="need the dual kernel"):
        _launch_1x128_kernel_for_test(x, rows_only=True, source_rows=torch.tensor([0, 1]))


@pytest.mark.parametrize("scale_format", FORMATS)
# (5, 0): no column tile; the launch divided by zero before.
@pytest.mark.parametrize("shape", [(70, 1100), (3, 128), (0, 256), (5, 0)])
def test_rows_kernel_matches_reference_scales_exactly_in_interpreter(
    shape, scale_format, fp8_mostly_equal
):
    x = _wide_range(*shape).bfloat16()  # 1100 columns: 9 tiles, one short, two column groups
    rows, cols = _launch_1x128_kernel_for_test(x, None, scale_format, rows_only=True)
    ref = quantize_1x128_reference(x, scale_format=scale_format)
    assert cols is None
    assert torch.equal(scale_to_float(rows.scale), scale_to_float(ref.scale))
    assert fp8_mostly_equal(rows.data, ref.data)


@pytest.mark.parametrize("segmented", [False, True])
def test_transposed_quantization_dequantizes_to_x_transposed_per_expert_tiles(segmented):
    x = torch.randn(261, 130)
    tiles = row_tiles(torch.tensor([100, 0, 161]), 261) if segmented else None
    rows, cols = quantize_1x128_dual_reference(x, tiles=tiles)
    xt = dequantize_tiles_transposed(cols, tiles, 261)
    assert xt.shape == (130, 261)
    torch.testing.assert_close(xt, x.T, rtol=2**-4, atol=1e-4)  # atol: fp8 subnormals
    if segmented:  # a tile never mixes experts: row 99's tile ends at row 99
        first_tile = cols.data.float()[0]  # [K, 128]
        assert torch.all(first_tile[:, 100:] == 0)


@pytest.mark.parametrize("scale_format", FORMATS)
def test_128x128_kernel_matches_reference_and_transpose_in_interpreter(
    scale_format, fp8_mostly_equal
):
    w = torch.randn(2, 260, 190, generator=torch.Generator().manual_seed(3)) * 3
    (q, s), (qt, st) = _launch_128x128(w, scale_format, True)
    (rq, rs), (rqt, rst) = quantize_128x128_reference(w, scale_format=scale_format, transpose=True)
    assert torch.equal(scale_to_float(s), scale_to_float(rs))
    assert torch.equal(scale_to_float(st), scale_to_float(rs).transpose(1, 2))
    assert fp8_mostly_equal(q, rq)
    assert torch.equal(rqt.float(), rq.float().transpose(1, 2))
    assert torch.equal(qt.float(), q.float().transpose(1, 2))
    deq = dequantize_128x128(Fp8Quantized(rq, rs))
    torch.testing.assert_close(deq, w, rtol=2**-4, atol=2**-6 * 3)


def test_public_quantizers_fall_back_to_references_on_cpu():
    x = torch.randn(5, 40)
    rows, cols = quantize_1x128_dual(x)
    ref_rows, ref_cols = quantize_1x128_dual_reference(x)
    assert torch.equal(rows.data.float(), ref_rows.data.float())
    assert torch.equal(cols.data.float(), ref_cols.data.float())
    (q, _), qt = quantize_128x128(torch.randn(16, 32))
    assert qt is None and q.shape == (16, 32)


def test_quantizers_accept_any_stride_where_no_neighbour_is_read():
    # One column (x.T of a row) and an empty tensor with zero strides are contiguous already.
    column = torch.randn(1, 5).T  # [5, 1], strides (1, 5)
    got = quantize_1x128(column)
    expected = quantize_1x128_reference(column.clone(memory_format=torch.contiguous_format))
    assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
    kernel_rows, _ = _launch_1x128_kernel_for_test(column, rows_only=True)
    assert torch.equal(kernel_rows.scale, expected.scale)
    empty = torch.empty_strided((0, 256), (0, 0))
    rows, cols = quantize_1x128_dual(empty)
    assert rows.data.shape == (0, 256) and cols.data.shape == (0, 256, 128)
    with pytest.raises(ValueError, match="contiguous last dim"):
        quantize_1x128(torch.randn(8, 256)[:, ::2])


def test_dual_quantization_rejects_tiles_of_other_rows():
    # On GPU the kernel would read and write the rows the tiles name, past the tensor's end.
    x = torch.randn(10, 128)
    with pytest.raises(ValueError, match="tiles cover 12 rows but the result has 10"):
        quantize_1x128_dual(x, tiles=row_tiles(torch.tensor([6, 6]), 12))
    with pytest.raises(ValueError, match="tiles cover 10 rows but the result has 3"):
        quantize_1x128_dual(
            x, tiles=row_tiles(torch.tensor([5, 5]), 10), source_rows=torch.tensor([0, 1, 2])
        )
    # Tiles of 8 rows claiming 10 (row_tiles refuses host counts that do not add up, but
    # does not check device counts).
    tiles = dataclasses.replace(row_tiles(torch.tensor([4, 4]), 8), num_rows=10)
    with pytest.raises(ValueError, match="groups hold 8 rows but the result has 10"):
        quantize_1x128_dual(x, tiles=tiles)


def test_quantize_rejects_unknown_scale_format():
    with pytest.raises(ValueError, match="scale_format"):
        quantize_1x128_dual(torch.randn(2, 8), scale_format="ue8m0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dual_gluon", [True, False])  # on Hopper: the Gluon or Triton kernel
@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("shape", [(4096, 2048), (1023, 777), (1, 128), (0, 256)])
def test_quantization_kernels_are_bit_exact_against_reference_on_gpu(
    shape, scale_format, dual_gluon, monkeypatch
):
    monkeypatch.setitem(QUANT_CONFIG, "dual_gluon", dual_gluon)
    gluon_launches = []
    launch_dual = quant_gluon.launch_dual
    monkeypatch.setattr(quant_gluon, "launch_dual",
                        lambda *args: gluon_launches.append(1) or launch_dual(*args))  # fmt: skip
    x = _wide_range(*shape, seed=1).cuda().bfloat16()
    counts = torch.tensor([shape[0] // 3, 0, shape[0] - shape[0] // 3]).cuda()
    gen = torch.Generator().manual_seed(3)
    source_rows = torch.randint(0, max(shape[0], 1), (shape[0],), generator=gen).cuda()
    weights = torch.rand(shape[0], generator=gen).cuda()
    options = [{}, {}, {"source_rows": source_rows, "row_weights": weights}]  # a fused permute
    for tiles, option in zip((None, row_tiles(counts, shape[0]), row_tiles(counts, shape[0])),
                             options, strict=True):  # fmt: skip
        rows, cols = quantize_1x128_dual(x, tiles=tiles, scale_format=scale_format, **option)
        ref_rows, ref_cols = quantize_1x128_dual_reference(
            x, tiles=tiles, scale_format=scale_format, **option
        )
        for got, ref in ((rows, ref_rows), (cols, ref_cols)):
            assert torch.equal(scale_to_float(got.scale), scale_to_float(ref.scale))
            got_bits, ref_bits = got.data.view(torch.uint8), ref.data.view(torch.uint8)
            bad = (got_bits != ref_bits).nonzero()
            detail = [
                (tuple(i), float(got.data[tuple(i)]), float(ref.data[tuple(i)]))
                for i in bad[:4].tolist()
            ]
            if got is rows and bad.shape[0]:  # the exact value before the cast
                r, c = bad[0].tolist()
                detail.append(float(x[r, c].float() / scale_to_float(ref.scale)[r, c // 128]))
            assert bad.shape[0] == 0, f"{bad.shape[0]} of {got_bits.numel()} differ: {detail}"
    # Row tiles of an empty x still launch: their tile slots hold zero padding.
    expect_gluon = dual_gluon and quant_gluon.supported(x)
    assert bool(gluon_launches) == expect_gluon, (dual_gluon, len(gluon_launches))
    rows = quantize_1x128(x, scale_format=scale_format)  # the rows-only kernel
    ref = quantize_1x128_reference(x, scale_format=scale_format)
    assert torch.equal(scale_to_float(rows.scale), scale_to_float(ref.scale))
    assert torch.equal(rows.data.view(torch.uint8), ref.data.view(torch.uint8))
    w = _wide_range(*shape, seed=2).cuda().contiguous()
    (q, s), (qt, st) = quantize_128x128(w, scale_format=scale_format, transpose=True)
    (rq, rs), (rqt, rst) = quantize_128x128_reference(w, scale_format=scale_format, transpose=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8))
    assert torch.equal(scale_to_float(s), scale_to_float(rs))
    assert torch.equal(scale_to_float(st), scale_to_float(rst))


def _special_values(num_rows, num_cols, dtype):
    """Rows of ±inf, the dtype's largest finite values, subnormals, and tiles mixing 1e30 with
    1e-30 (the small ones round to zero), between ordinary rows; column 1 all zero."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_rows, num_cols, generator=gen)
    sign = torch.where(torch.rand(num_cols, generator=gen) < 0.5, -1.0, 1.0)
    x[0, 3], x[1, 130] = float("inf"), float("-inf")
    x[2] = sign * info.max * torch.rand(num_cols, generator=gen).clamp_min(0.5)
    x[3] = sign * info.smallest_normal * torch.rand(num_cols, generator=gen) / 4  # subnormal
    x[4] = sign * torch.where(torch.arange(num_cols) % 7 == 0, 1e30, 1e-30)
    x[5] = 0.0
    x[:, 1] = 0.0
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale_format", FORMATS)
def test_kernels_equal_references_on_inf_huge_and_subnormal_values_on_gpu(scale_format):
    x = _special_values(300, 384, torch.bfloat16).cuda()
    assert (x[3] != 0).any() and (x[3].abs() < torch.finfo(torch.bfloat16).smallest_normal).all()
    tiles = row_tiles(torch.tensor([100, 0, 200]).cuda(), 300)
    pairs = [
        (quantize_1x128(x, scale_format=scale_format),
         quantize_1x128_reference(x, scale_format=scale_format)),
        *zip(quantize_1x128_dual(x, tiles=tiles, scale_format=scale_format),
             quantize_1x128_dual_reference(x, tiles=tiles, scale_format=scale_format),
             strict=True),
    ]  # fmt: skip
    w = _special_values(300, 384, torch.float32).cuda()
    pairs += zip(
        quantize_128x128(w, scale_format=scale_format, transpose=True),
        quantize_128x128_reference(w, scale_format=scale_format, transpose=True),
        strict=True,
    )
    for got, ref in pairs:
        got, ref = Fp8Quantized(*got), Fp8Quantized(*ref)
        assert torch.equal(scale_to_float(got.scale), scale_to_float(ref.scale))
        assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert not torch.isnan(got.data.float()).any()
