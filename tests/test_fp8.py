"""FP8's numerics (engine/ops/fp8/): each recipe's quantisation against an fp64 reference with
the recipe's rounding, the FP8 GEMMs (real torch._scaled_mm products) against the fp64 product
of the dequantised operands (padded as CUDA needs, empty, dequantized where the device lacks
row-wise products), a layer's FP8 outputs and gradients within the formats' error of fp32's,
torchao's GEMMs against the engine's, and delayed scaling's history and records. Training in
FP8 through the engine: tests/test_fp8_training.py."""

from __future__ import annotations

import math

import pytest
import torch

from engine.ops.fp8.delayed import DelayedScaling, update_delayed_scales
from engine.ops.fp8.gemm import fp8_gemm
from engine.ops.fp8.linear import Fp8Linear, Fp8Scales
from engine.ops.fp8.quantize import E4M3, E5M2, FP8_MAX, block_amax, quantize
from engine.ops.fp8.recipe import RECIPES, Fp8Recipe
from tests.distributed import rel_err


def _fp8_table(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of the format, ascending (fp64), and its bit pattern."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).double()
    finite = torch.isfinite(values)
    order = torch.argsort(values[finite])
    return values[finite][order], codes[finite][order]


def _round_to_format(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (fp64) to the nearest value of the format, ties to the even bit pattern, saturating."""
    values, codes = _fp8_table(dtype)
    x = x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    upper = torch.searchsorted(values, x).clamp(1, len(values) - 1)
    low, high = values[upper - 1], values[upper]
    tie_to_high = ((high - x) == (x - low)) & (codes[upper] % 2 == 0)
    return torch.where(((high - x) < (x - low)) | tie_to_high, high, low)


def _reference(x: torch.Tensor, dtype, block, rule) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale per block) in fp64, block by block, by the recipe's rule."""
    m, k = x.shape
    rows, cols = block or (m, k)
    rows, cols = min(rows, m), min(cols, k)
    out = torch.empty(m, k, dtype=torch.float64)
    scales = torch.empty(math.ceil(m / rows), math.ceil(k / cols), dtype=torch.float64)
    for i in range(0, m, rows):
        for j in range(0, k, cols):
            part = x[i : i + rows, j : j + cols].double()
            amax = part.abs().max().item()
            if rule == "mx":
                scale = 2.0 ** -math.ceil(math.log2(amax / FP8_MAX[dtype]))
            else:
                scale = FP8_MAX[dtype] / amax
                if rule == "power_of_two":
                    scale = 2.0 ** math.floor(math.log2(scale))
            scales[i // rows, j // cols] = scale
            out[i : i + rows, j : j + cols] = _round_to_format(part * scale, dtype) / scale
    return out, scales


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_block_quantisation_equals_the_fp64_reference(recipe, role):
    r = Fp8Recipe("hybrid", recipe)
    x = torch.randn(160, 300, generator=torch.Generator().manual_seed(1)) * 3
    x[7, :50] *= 1000  # a block of large values: other blocks keep their own scales
    q = quantize(x, r.dtype(role), r.block(role), r.rule)
    expected, scales = _reference(x, r.dtype(role), r.block(role), r.rule)
    assert torch.equal(q.dequantize(torch.float64), expected)
    assert torch.equal(1 / q.scale_inv.double(), scales)


def test_tensorwise_and_delayed_quantisation():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for dtype in (E4M3, E5M2):
        q = quantize(x.float(), dtype)  # current: fp8_max / amax
        scale = FP8_MAX[dtype] / x.float().abs().max().double()
        assert 1 / q.scale_inv.double() == pytest.approx(scale.item(), rel=1e-7)
        expected = _round_to_format(x.float().double() * (1 / q.scale_inv.double()), dtype)
        assert (q.data.double() - expected).abs().max() == 0
        # a given (delayed) scale, too small for the tensor: saturation at +-max
        q = quantize(x.float(), dtype, scale=torch.tensor(FP8_MAX[dtype]))
        assert q.data.double().abs().max() == FP8_MAX[dtype]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_gemms_are_the_products_of_the_quantised_operands(recipe):
    r = Fp8Recipe("hybrid", recipe)
    g = torch.Generator().manual_seed(3)
    x, w, dy = (
        torch.randn(64, 256, generator=g),
        torch.randn(96, 256, generator=g),
        torch.randn(64, 96, generator=g),
    )
    for a, b, ra, rb in ((x, w, "input", "weight"), (dy, w.t(), "grad", "weight"),
                         (dy.t(), x.t(), "grad", "input")):  # fmt: skip
        qa = quantize(a, r.dtype(ra), r.block(ra), r.rule)
        qb = quantize(b, r.dtype(rb), r.block(rb), r.rule)
        expected = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
        assert rel_err(fp8_gemm(qa, qb, torch.float32), expected) < 1e-6


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_dequantized_block_products_equal_the_scaled_ones(recipe):
    """Where _scaled_mm has no row-wise products into fp32 (CUDA), a block recipe's products
    run as fp32 GEMMs of the dequantized operands: the same as the row-wise scaled products
    within fp32's order of additions, through a layer's three GEMMs. This CPU has them."""
    from engine.ops.fp8.probe import rowwise_fp32_products

    assert rowwise_fp32_products(torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(64, 256, generator=g), torch.randn(96, 256, generator=g) / 10
    dy = torch.randn(64, 96, generator=g)
    results = []
    for dequantized in (False, True):
        fp8 = Fp8Linear(Fp8Recipe("hybrid", recipe))
        fp8.dequantized_blocks = dequantized
        y, scales = fp8.forward(x, w)
        dx, grad = fp8.input_grad(dy, w, scales)
        results.append((y, dx, fp8.weight_grad(dy, x, scales, grad)))
    for scaled, dequantized in zip(*results, strict=True):
        assert rel_err(dequantized, scaled) < 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
def test_padded_and_empty_fp8_gemms(recipe):
    """CUDA's alignment (K and N padded with zeros to multiples of 16, asked for here on the
    CPU) gives the unpadded products, up to the order of the fp32 additions (which the CPU's
    kernel may change with K: 6e-6 apart on an AMD EPYC, bit for bit on others); an expert
    without tokens gets zeros through its layer's forward and both backward GEMMs."""
    r = Fp8Recipe("hybrid", recipe)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 200, generator=g), torch.randn(37, 200, generator=g)
    qa = quantize(a, r.dtype("grad"), r.block("grad"), r.rule)
    qb = quantize(b, r.dtype("input"), r.block("input"), r.rule)
    exact = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    padded, unpadded = fp8_gemm(qa, qb, torch.float32, align=16), fp8_gemm(qa, qb, torch.float32)
    bound = 1e-6 * exact.abs().max()  # (measured: 6.2e-6 apart, each 1.4e-5 from exact, of 39)
    assert (padded - unpadded).abs().max() < bound
    assert (padded.double() - exact).abs().max() < 2e-6 * exact.abs().max()
    delayed = DelayedScaling(r, "cpu") if recipe == "delayed" else None
    fp8, w = Fp8Linear(r, delayed), torch.randn(48, 64, generator=g)
    none, dy = torch.zeros(0, 64), torch.zeros(0, 48)
    y, scales = fp8.forward(none, w)
    dx, grad = fp8.input_grad(dy, w, scales)
    dw = fp8.weight_grad(dy, none, scales, grad)
    assert (y.shape, dx.shape, dw.shape) == ((0, 48), (0, 64), (48, 64)) and not dw.any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_layer_in_fp8_is_within_the_formats_error_of_fp32(recipe):
    """Output and both gradients of y = x W^T in FP8 against fp32 (hybrid: the gradient in
    E5M2, 2 mantissa bits; E4M3 has 3)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(128, 256, generator=g, requires_grad=True)
    w = (torch.randn(192, 256, generator=g) / 16).requires_grad_()
    dy = torch.randn(128, 192, generator=g)
    ref = x @ w.t()
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
    delayed = DelayedScaling(Fp8Recipe("hybrid", recipe), "cpu") if recipe == "delayed" else None
    fp8 = Fp8Linear(Fp8Recipe("hybrid", recipe), delayed)
    if delayed is not None:  # a first step records the amaxes the second one's scales use
        fp8.input_grad(dy, w.detach(), fp8.forward(x.detach(), w.detach())[1])
        update_delayed_scales([delayed], ())
    y, scales = fp8.forward(x.detach(), w.detach())
    dx, grad = fp8.input_grad(dy, w.detach(), scales)
    dw = fp8.weight_grad(dy, x.detach(), scales, grad)
    assert torch.equal(dw, fp8.weight_grad(dy, x.detach(), Fp8Scales()))  # nothing reused
    assert rel_err(y, ref) < 0.04  # E4M3 x E4M3
    assert rel_err(dx, ref_dx) < 0.08 and rel_err(dw, ref_dw) < 0.08  # E5M2 x E4M3


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_torchao_backend_computes_the_native_products(recipe):
    """--fp8-backend torchao (torchao's Float8TrainingTensor casts and scaled matmuls) gives
    the engine's own products within the output dtype's rounding: torchao divides fp8_max by
    the amax in fp64 (ours in fp32), a scale one fp32 step apart at times, which moves a rare
    element by a step of the format (measured: 1 of 8,192 in bf16). In bf16 the weight
    gradient is made in bf16, as torchao makes it (ours: in fp32)."""
    pytest.importorskip("torchao")
    from engine.ops.fp8.torchao_linear import TorchaoFp8Linear

    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g) / 10
    dy = torch.randn(64, 96, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        r = Fp8Recipe("hybrid", recipe)
        results = []
        for kind in (Fp8Linear, TorchaoFp8Linear):
            fp8 = kind(r, DelayedScaling(r, "cpu") if recipe == "delayed" else None)
            args = (x.to(dtype), w.to(dtype))
            y, scales = fp8.forward(*args)
            dx, grad = fp8.input_grad(dy.to(dtype), args[1], scales)
            results.append((y, dx, fp8.weight_grad(dy.to(dtype), args[0], scales, grad)))
        bound = 1e-6 if dtype == torch.float32 else 4e-3  # (bf16's step: 2^-8)
        for ours, theirs in zip(*results, strict=True):
            assert rel_err(theirs.float(), ours.float()) < bound


def test_delayed_scaling_history_and_scales():
    recipe = Fp8Recipe("hybrid", "delayed", margin=1, amax_history_len=3, amax_compute_algo="max")
    state = DelayedScaling(recipe, "cpu")
    assert torch.equal(state.scale, torch.ones(3))  # the first step's
    for amaxes in ([4.0, 2.0, 8.0], [1.0, 0.0, 16.0], [2.0, 0.0, 1.0], [1.0, 0.0, 1.0]):
        state.amax_now = torch.tensor(amaxes)
        update_delayed_scales([state], ())
    # the last 3 steps' history, newest first; the largest of each column; margin 1
    assert torch.equal(state.history, torch.tensor([[1.0, 0, 1], [2, 0, 1], [1, 0, 16]]))
    expected = torch.tensor([448 / 2 / 2, 448 / 2 / 2, 57344 / 16 / 2])
    assert torch.allclose(state.scale, expected)  # (the weight's zeros kept the last scale)
    newest = DelayedScaling(Fp8Recipe("hybrid", "delayed", amax_history_len=3), "cpu")
    for amaxes in ([4.0, 2.0, 8.0], [1.0, 1.0, 2.0]):
        newest.amax_now = torch.tensor(amaxes)
        update_delayed_scales([newest], ())
    assert torch.allclose(newest.scale, torch.tensor([448.0, 448.0, 57344 / 2]))


def test_a_layer_records_its_amaxes_in_training_only():
    """Through the layer (the autograd Function, whose forward runs without gradients): a
    training forward and backward record the amaxes of x, W and dY; an evaluation forward
    (no gradients) records nothing."""
    from parallel.tensor_parallel.init import normal_init
    from parallel.tensor_parallel.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(64, 32, tp_group=None, init_method=normal_init(0.1), init_seed=3)
    recipe = Fp8Recipe("hybrid", "delayed")
    layer.fp8 = Fp8Linear(recipe, DelayedScaling(recipe, "cpu"))
    x = torch.randn(4, 2, 64)
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.fp8.delayed.amax_now, torch.zeros(3))
    layer(x).square().sum().backward()
    amax = layer.fp8.delayed.amax_now
    assert amax[0] == x.abs().max() and amax[1] == layer.weight.detach().abs().max()
    assert amax[2] > 0
    update_delayed_scales([layer.fp8.delayed], ())
    assert torch.allclose(layer.fp8.delayed.scale[:2], 448.0 / amax[:2])


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_gather_pieces_quantise_as_the_whole_weight(recipe):
    """--fp8-param-gather's arithmetic (parallel/data_parallel/fp8_gather.py) on a 300 x 260
    weight (3 x 3 blocks of 128 x 128 under blockwise, the last ones partial) cut at shard
    edges that fall inside blocks: the pieces' amaxes, maxed, are the whole weight's (per
    block); each piece's bytes, put together and dequantised, are the engine's quantisation
    of the whole weight (engine/ops/fp8/quantize.py), dequantised."""
    from parallel.data_parallel import fp8_gather

    fp8 = Fp8Linear(Fp8Recipe(format="e4m3", recipe=recipe))
    weight = torch.nn.Parameter(torch.randn(300, 260) * torch.rand(300, 1) * 4)
    weight.fp8_gather = fp8
    cuts = [0, 7_001, 40_000, 50_013, weight.numel()]
    flat = weight.detach().reshape(-1)
    grid = fp8_gather._grid(weight)
    amax = torch.zeros(grid[0] * grid[1])
    for first, last in zip(cuts, cuts[1:], strict=False):
        piece = torch.zeros_like(amax)
        blocks = fp8_gather.block_of(weight, first, last)
        amax = torch.maximum(amax, piece.scatter_reduce(0, blocks, flat[first:last].abs(), "amax"))
    block = fp8.weight_block or (300, 260)
    whole = quantize(weight.detach(), E4M3, block, Fp8Recipe(recipe=recipe).rule)
    assert grid == tuple(whole.scale.shape)
    assert torch.equal(amax.view(grid), block_amax(weight.detach(), block))
    scales = fp8.gather_scale(amax.view(grid))
    assert torch.equal(scales.reshape(grid), whole.scale)
    data = torch.cat([
        fp8_gather.to_fp8_bytes(
            flat[first:last], fp8_gather._scales_of(weight, scales, first, last)
        )
        for first, last in zip(cuts, cuts[1:], strict=False)
    ])  # fmt: skip
    assert torch.equal(data.view(E4M3).view(300, 260).float(), whole.data.float())
    assert torch.equal(fp8_gather._dequantized(weight, data, scales), whole.dequantize())


def test_grouped_fp8_gemm_arguments_give_each_experts_product():
    """engine/ops/fp8/grouped.py's operands of torch._scaled_grouped_mm (CUDA-only): accepted by
    its shape and layout checks (run on the meta device), and, multiplied as the kernel defines
    (each row of A times its scale, each column of expert e's B times its scale, expert e's rows
    with expert e's B), each expert's FP8 product (an expert without tokens among them)."""
    from engine.ops.fp8.grouped import grouped_arguments, grouped_fp8_gemm

    g = torch.Generator().manual_seed(9)
    rows, k, n = [5, 0, 19, 8], 32, 48
    a_parts = [quantize(torch.randn(r, k, generator=g) * (e + 1), E4M3) for e, r in enumerate(rows)]
    b_parts = [quantize(torch.randn(n, k, generator=g) / (e + 1), E4M3) for e in range(4)]
    stacked, weights, scale_a, scale_b, ends = grouped_arguments(a_parts, b_parts)
    assert weights.stride()[1:] == (1, k) and ends.tolist() == [5, 5, 24, 32]
    meta = [t.to("meta") for t in (stacked, weights, scale_a, scale_b, ends)]
    out = torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=torch.bfloat16)
    assert out.shape == (sum(rows), n) and out.dtype == torch.bfloat16
    starts = [0, *ends.tolist()[:-1]]
    for e, (start, end) in enumerate(zip(starts, ends.tolist(), strict=True)):
        a = stacked[start:end].double() * scale_a[start:end, None].double()
        b = weights[e].double() * scale_b[e][None, :].double()
        x, w = (q.data.double() * q.scale_inv.double() for q in (a_parts[e], b_parts[e]))
        assert torch.allclose(a @ b, x @ w.t(), rtol=1e-12, atol=0), e
    products = grouped_fp8_gemm(a_parts, b_parts, torch.float32)  # (the CPU: each in turn)
    each = torch.cat([fp8_gemm(a, b, torch.float32) for a, b in zip(a_parts, b_parts, strict=True)])
    assert torch.equal(products, each)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_grouped_fp8_gemm_on_cuda_is_each_experts_product():
    """On a CUDA device that runs torch._scaled_grouped_mm (compute capability 9.0 or 10.0 in
    the PyTorch versions seen so far): the experts' products as one kernel equal each expert's
    torch._scaled_mm product within bf16's rounding of the output (an expert without tokens
    among them)."""
    from engine.ops.fp8 import grouped
    from engine.ops.fp8.probe import grouped_products

    if not grouped_products(torch.device("cuda")):
        pytest.skip("torch._scaled_grouped_mm does not run on this GPU")
    g = torch.Generator().manual_seed(3)
    rows, k, n = [32, 0, 48, 16], 64, 128
    a_parts = [quantize(torch.randn(r, k, generator=g).cuda() * (e + 1), E4M3)
               for e, r in enumerate(rows)]  # fmt: skip
    b_parts = [quantize(torch.randn(n, k, generator=g).cuda() / (e + 1), E4M3) for e in range(4)]
    assert grouped._one_kernel(a_parts, b_parts, torch.bfloat16)
    products = grouped.grouped_fp8_gemm(a_parts, b_parts, torch.bfloat16, kernel=True).float()
    each = torch.cat(
        [fp8_gemm(a, b, torch.bfloat16) for a, b in zip(a_parts, b_parts, strict=True)]
    ).float()
    assert products.shape == (sum(rows), n)
    assert ((products - each).abs() <= 2**-7 * each.abs() + 1e-6).all()
