"""FP8 training (engine/ops/fp8/): each recipe's quantisation against an fp64 reference with
the recipe's rounding, the FP8 GEMMs (real torch._scaled_mm products) against the fp64 product
of the dequantised operands, a layer's FP8 outputs and gradients within the formats' error of
fp32's, delayed scaling's history, and training: a tensor-, pipeline- and data-parallel FP8
run equal to one process's within 1e-5, a resumed delayed-scaling run bit for bit, and bad
flags in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.ops.fp8.delayed import DelayedScaling, update_delayed_scales
from engine.ops.fp8.gemm import fp8_gemm
from engine.ops.fp8.linear import Fp8Linear, Fp8Scales
from engine.ops.fp8.quantize import E4M3, E5M2, FP8_MAX, quantize
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
    CPU) gives the unpadded products; an expert without tokens gets zeros through its layer's
    forward and both backward GEMMs."""
    r = Fp8Recipe("hybrid", recipe)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 200, generator=g), torch.randn(37, 200, generator=g)
    qa = quantize(a, r.dtype("grad"), r.block("grad"), r.rule)
    qb = quantize(b, r.dtype("input"), r.block("input"), r.rule)
    assert torch.equal(fp8_gemm(qa, qb, torch.float32, align=16), fp8_gemm(qa, qb, torch.float32))
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


def _args(dataset_prefix, tokenizer_model, tmp_path, name, **extra):
    from tests.test_training import base_args

    flags = {"--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "256",
             "--num-layers": "2", "--train-iters": "5", "--attention-dropout": "0.0",
             "--hidden-dropout": "0.0", "--log-jsonl": str(tmp_path / f"{name}.jsonl"),
             **extra}  # fmt: skip
    return base_args(dataset_prefix, tokenizer_model, **flags)


LAYOUTS = {
    "delayed": (8, {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                    "--sequence-parallel": True, "--use-distributed-optimizer": True}),
    "tensorwise": (4, {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}),
    "blockwise": (2, {"--tensor-model-parallel-size": "2", "--sequence-parallel": True}),
    "mxfp8": (4, {"--tensor-model-parallel-size": "2"}),
}  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
def test_parallel_fp8_run_equals_one_process(recipe, dataset_prefix, tokenizer_model, tmp_path):
    """Under TP (and SP, PP, DP) the FP8 run follows one process's FP8 run: the first step's
    loss within 1e-5 relative, every step's within 5e-5. (Not 1e-5 throughout, as fp32 runs
    are: FP8's rounding is not continuous, so the last-bit differences of two layouts' fp32
    sums move elements across rounding boundaries, by a step of the format each; measured
    up to 2.5e-5 by the fifth step.)"""
    from tests.test_training import losses, pretrain

    fp8 = {"--fp8-format": "hybrid", "--fp8-recipe": recipe}
    if recipe == "delayed":
        fp8 |= {"--fp8-amax-history-len": "4", "--fp8-amax-compute-algo": "max"}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one", **fp8))
    world, layout = LAYOUTS[recipe]
    pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, "many", **fp8, **layout))
    one, many = losses(tmp_path / "one.jsonl"), losses(tmp_path / "many.jsonl")
    assert sorted(one) == sorted(many) == list(range(1, 6))
    apart = [abs(many[s] - one[s]) / one[s] for s in one]
    assert apart[0] < 1e-5 and max(apart) < 5e-5, apart
    if recipe == "delayed":
        pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "plain"))
        plain = losses(tmp_path / "plain.jsonl")
        from_fp32 = [abs(one[s] - plain[s]) / plain[s] for s in range(2, 6)]
        assert max(from_fp32) > 1e-5 and max(from_fp32) < 0.01  # FP8 ran, and trains as fp32


def _fp8_states(root: str, iteration: int) -> dict[str, torch.Tensor]:
    """The FP8 entries (amax histories, scales) of a checkpoint."""
    from engine.checkpoint.files import iteration_dir
    from engine.checkpoint.load import open_checkpoint, read_tensors

    path = iteration_dir(root, iteration)
    reader = open_checkpoint(path)
    wanted = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith("fp8/")
    }
    read_tensors(path, wanted, reader=reader)
    return wanted


def test_fp8_experts_under_expert_parallelism_follow_one_process(
    dataset_prefix, tokenizer_model, tmp_path
):
    """An MoE model's experts in FP8, each with its own scales (whatever --moe-grouped-gemm
    says), under data x expert parallelism (DP2 x EP2, the weights gathered in FP8, the
    experts' over the expert data-parallel group) against one process, delayed scaling.
    The first step's amaxes of every FP8 weight (reduced over the ranks holding that weight:
    an expert's over the expert data-parallel group, here itself alone; the dense layers'
    over DP; the history's oldest row) equal one process's: the weight's exactly, its input's
    and output gradient's within one E4M3 step (DP2's gradients are twice one process's, each
    rank's loss one micro-batch's, not the mean of two); and the losses follow within 1e-4.
    Not the dense layouts' 1e-5: under EP an expert's GEMMs take the tokens of both ranks'
    micro-batches at once, so its first step's scales (each tensor's own amax) come from
    other sets of tokens than one process's, and FP8's steps are coarse (E4M3: 2^-3)."""
    from engine.model.moe.experts import Experts
    from engine.ops.fp8.apply import delayed_states
    from tests.test_moe_training import MOE
    from tests.test_training import losses, pretrain

    moe = MOE | {"--moe-layer-freq": "1", "--fp8-format": "hybrid", "--fp8-amax-history-len": "5",
                 "--fp8-amax-compute-algo": "max"}  # fmt: skip
    ep2 = {"--expert-model-parallel-size": "2", "--fp8-param-gather": True}  # (the experts' too)
    for name, world, extra in (("one", 1, {}), ("ep2", 2, ep2)):
        flags = moe | extra | {"--save": str(tmp_path / f"{name}-ckpt"), "--save-interval": "5"}
        pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, name, **flags))
    one, ep = losses(tmp_path / "one.jsonl"), losses(tmp_path / "ep2.jsonl")
    assert sorted(one) == sorted(ep) == list(range(1, 6))
    apart = [abs(ep[s] - one[s]) / one[s] for s in one]
    assert max(apart) < 1e-4, apart
    states = [_fp8_states(str(tmp_path / f"{name}-ckpt"), 5) for name in ("one", "ep2")]
    assert states[0].keys() == states[1].keys()
    histories = [k for k in states[0] if k.endswith("amax_history")]
    assert sum(".experts.local_experts." in k for k in histories) == 2 * 4 * 2  # 2 layers
    for key in histories:
        one_process, ep2 = states[0][key][-1], states[1][key][-1] * torch.tensor([1, 1, 0.5])
        assert one_process[1] == ep2[1] and torch.allclose(ep2, one_process, rtol=0.125), key
    model = _fp8_model(_args(dataset_prefix, tokenizer_model, tmp_path, "model", **moe))
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(e.linear_fc1.fp8 is not None for m in experts for e in m.local_experts)
    assert len(delayed_states([model], experts=True)) == 2 * 4 * 2
    assert len(delayed_states([model], experts=False)) == 2 * 2  # attention's two linears


def _checkpoint_tensors(root: str, iteration: int, prefix: str) -> dict[str, torch.Tensor]:
    from engine.checkpoint.files import iteration_dir
    from engine.checkpoint.load import open_checkpoint, read_tensors

    path = iteration_dir(root, iteration)
    reader = open_checkpoint(path)
    wanted = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    read_tensors(path, wanted, reader=reader)
    return wanted


def test_fp8_param_gather_computes_what_the_run_without_it_does(
    dataset_prefix, tokenizer_model, tmp_path
):
    """--fp8-param-gather under TP2 x DP2 with the distributed optimizer (tensorwise: each
    weight's scale from its whole amax, reduced over the shards and TP) follows one process
    without it within
    the layouts' bounds; its FP8 layers' weights hold FP8 values (at most 255 distinct values
    a tensor, one scale each), their masters not; a delayed-scaling run with it resumes bit
    for bit (the weights published again from the masters read)."""
    from tests.test_training import losses, pretrain, straight_and_resumed

    fp8 = {"--fp8-format": "hybrid", "--fp8-recipe": "tensorwise"}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one", **fp8))
    ckpt = str(tmp_path / "gather-ckpt")
    gather = fp8 | {"--use-distributed-optimizer": True, "--fp8-param-gather": True,
                    "--tensor-model-parallel-size": "2", "--save": ckpt,
                    "--save-interval": "5"}  # fmt: skip
    pretrain(4, _args(dataset_prefix, tokenizer_model, tmp_path, "gather", **gather))
    one, many = losses(tmp_path / "one.jsonl"), losses(tmp_path / "gather.jsonl")
    assert sorted(one) == sorted(many) == list(range(1, 6))
    apart = [abs(many[s] - one[s]) / one[s] for s in one]
    assert apart[0] < 1e-5 and max(apart) < 5e-5, apart
    weights = _checkpoint_tensors(ckpt, 5, "model/")
    fp8_weights = [k for k in weights if ".linear_" in k and ".weight" in k]
    assert len(fp8_weights) == 2 * 6  # q, k, v, the projection, fc1 and fc2 of each layer
    assert all(weights[k].unique().numel() <= 255 for k in fp8_weights)
    masters = _checkpoint_tensors(ckpt, 5, "optim/")
    masters = [v for k, v in masters.items() if ".weight/master" in k and "linear_fc" in k]
    assert len(masters) == 4 and all(m.unique().numel() > 1000 for m in masters)

    delayed = {"--fp8-format": "hybrid", "--fp8-amax-history-len": "2",
               "--use-distributed-optimizer": True, "--fp8-param-gather": True}  # fmt: skip

    def args_of(name, **extra):
        return _args(dataset_prefix, tokenizer_model, tmp_path, name, **delayed, **extra)

    straight, resumed = straight_and_resumed(args_of, tmp_path, 3)
    assert resumed == straight and sorted(straight) == list(range(1, 6))


def test_torchao_backend_under_tensor_parallelism_follows_one_process(
    dataset_prefix, tokenizer_model, tmp_path
):
    """A TP2 run on torchao's FP8 GEMMs (tensorwise, each shard's amax reduced over TP by the
    engine) follows one process on the engine's own within the layouts' bounds."""
    pytest.importorskip("torchao")
    from tests.test_training import losses, pretrain

    fp8 = {"--fp8-format": "hybrid", "--fp8-recipe": "tensorwise"}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "native", **fp8))
    torchao = fp8 | {"--fp8-backend": "torchao", "--tensor-model-parallel-size": "2"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, "torchao", **torchao))
    one, tp2 = losses(tmp_path / "native.jsonl"), losses(tmp_path / "torchao.jsonl")
    assert sorted(one) == sorted(tp2) == list(range(1, 6))
    apart = [abs(tp2[s] - one[s]) / one[s] for s in one]
    assert apart[0] < 1e-5 and max(apart) < 5e-5, apart


def test_delayed_scaling_resumes_bit_for_bit(dataset_prefix, tokenizer_model, tmp_path):
    """The amax histories and scales are in the checkpoint: a run stopped at step 3 and resumed
    gives the straight run's losses bit for bit, resumed under TP2 within the layouts' 5e-5;
    another history length is refused."""
    from tests.test_training import losses, pretrain, straight_and_resumed

    fp8 = {"--fp8-format": "hybrid", "--fp8-amax-history-len": "3",
           "--fp8-amax-compute-algo": "max", "--train-iters": "5"}  # fmt: skip

    def args_of(name, **extra):
        return _args(dataset_prefix, tokenizer_model, tmp_path, name, **fp8, **extra)

    straight, resumed = straight_and_resumed(args_of, tmp_path, 3)
    assert resumed == straight and sorted(straight) == list(range(1, 6))
    ckpt = str(tmp_path / "ckpt")
    tp2 = {"--load": ckpt, "--tensor-model-parallel-size": "2"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, "tp2", **fp8, **tp2))
    apart = [abs(v - straight[s]) / straight[s] for s, v in losses(tmp_path / "tp2.jsonl").items()]
    assert len(apart) == 2 and max(apart) < 5e-5, apart
    other = dict(fp8, **{"--fp8-amax-history-len": "2", "--load": ckpt})
    with pytest.raises(AssertionError, match="give the checkpoint's --fp8-amax-history-len"):
        pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "c", **other))


def _fp8_model(argv: list[str]):
    """One process's model of this command line, FP8 put on it as a run does."""
    from engine.model.builder import build_model_chunks
    from engine.ops.fp8.apply import enable_fp8, fp8_recipe
    from engine.pretrain import parse
    from engine.train.preflight import prepare
    from parallel.state import ParallelState

    cfg = prepare(parse(argv), 1)
    (model,) = build_model_chunks(cfg.model, ParallelState.local())
    layers = cfg.model.num_layers
    enable_fp8([model], fp8_recipe(cfg.runtime), layers, cfg.runtime.fp8_kept_layers())
    return model


def test_first_and_last_layers_stay_in_high_precision(dataset_prefix, tokenizer_model):
    """--first-last-layers-bf16 counts layers over the whole model: with 1 at the start and 2
    at the end of 5, only layers 1 and 2 get FP8, on whichever pipeline stage they sit."""
    flags = ["--num-layers", "5", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8",
             "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"]  # fmt: skip
    from tests.test_training import base_args

    model = _fp8_model(base_args(dataset_prefix, tokenizer_model) + flags)
    in_fp8 = sorted(
        number
        for number, layer in model.layers.items()
        if any(getattr(m, "fp8", None) is not None for m in layer.modules())
    )
    assert in_fp8 == ["1", "2"]
    outside = [m for name, m in model.named_modules() if not name.startswith("layers.")]
    assert all(getattr(m, "fp8", None) is None for m in outside)  # embedding, output layer


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


def test_bench_fp8_trains_each_recipe_beside_bf16(dataset_prefix, tokenizer_model, tmp_path):
    """tools/bench_fp8.py at a tiny size: BF16 and two recipes, a row each,
    the FP8 runs' losses apart from BF16's (FP8 ran) but close to them, JSON and plot."""
    from tests.cli import run_tool

    done = run_tool(
        "bench_fp8.py", "--recipes", "tensorwise", "mxfp8", "--seeds", "1",
        "--train-iters", "3", "--average-last", "2", "--num-layers", "1", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--data-path", dataset_prefix,
        "--tokenizer-model", tokenizer_model, "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "bench_fp8.json").read_text())["rows"]
    assert [row["recipe"] for row in rows] == ["bf16", "tensorwise", "mxfp8"]
    runs = json.loads((tmp_path / "bench_fp8.json").read_text())["runs"]
    for recipe in ("tensorwise", "mxfp8"):
        for fp8, bf16 in zip(runs[recipe], runs["bf16"], strict=True):
            apart = [abs(a - b) for a, b in zip(fp8["loss"], bf16["loss"], strict=True)]
            assert len(apart) == 3 and 0 < max(apart) < 0.05, (recipe, apart)
    assert "mxfp8" in done.stdout and (tmp_path / "bench_fp8.png").stat().st_size > 10_000
