"""engine/optim/muon.py: Muon's update against torch.optim.Muon (the same arithmetic: bit for
bit), Newton-Schulz in fp32 against an fp64 reference, each scale mode, a fused QKV weight
orthogonalised as its Q, K and V matrices, and bad settings refused."""

from __future__ import annotations

import math

import pytest
import torch

from engine.optim.muon import COEFFICIENTS, Muon, MuonMatrix, newton_schulz, scale_factor

# torch.optim.Muon's adjust_lr_fn and the same update in megatron-core's terms
TORCH_SCALES = {"original": ("shape_scaling", 1.0), "match_rms_adamw": ("spectral", 0.2)}


def _steps(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("adjust", sorted(TORCH_SCALES))
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_update_equals_torch_muon(adjust, nesterov):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32, 96), (48, 48)]  # tall (transposed), wide, square
    start = [torch.randn(s, generator=g) / 8 for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    ours, theirs = [p.clone() for p in start], [p.clone() for p in start]
    mode, extra = TORCH_SCALES[adjust]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5)
    _steps(Muon(ours, **settings, coefficients="simple", precision="medium",
                scale_mode=mode, extra_scale_factor=extra), ours, grads)  # fmt: skip
    reference = torch.optim.Muon(theirs, **settings, adjust_lr_fn=adjust)
    _steps(reference, theirs, grads)
    for a, b, p in zip(ours, theirs, start, strict=True):
        assert torch.equal(a, b) and not torch.equal(a, p)


def _reference_ns(x: torch.Tensor, steps: int, sets) -> torch.Tensor:
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / x.norm().clamp(min=1e-7)
    for step in range(steps):
        a, b, c = sets[step % len(sets)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("coefficients", sorted(COEFFICIENTS))
def test_newton_schulz_in_fp32_equals_fp64_and_orthogonalises(coefficients):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 40, generator=g)
    ours = newton_schulz(x, 5, coefficients, precision="highest")
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    reference = _reference_ns(x, 5, COEFFICIENTS[coefficients])
    assert (ours.double() - reference).abs().max() < 1e-5
    singular = torch.linalg.svdvals(ours.double())
    assert singular.min() > 0.5 and singular.max() < 1.3  # near orthogonal (not exactly: 5 steps)
    half = newton_schulz(x, 5, coefficients, precision="medium")
    assert half.dtype == torch.bfloat16 and (half.double() - reference).abs().max() < 0.05


def test_scale_modes():
    assert scale_factor("spectral", 128, 32) == math.sqrt(128)
    assert scale_factor("shape_scaling", 128, 32) == 2.0
    assert scale_factor("shape_scaling", 32, 128) == 1.0
    assert scale_factor("unit_rms_norm", 32, 128) == 0.5
    with pytest.raises(ValueError, match="not one of"):
        scale_factor("other", 1, 1)


def test_a_fused_qkv_weight_is_orthogonalised_as_its_q_k_and_v():
    """Rows per query group [Q (2 heads x 8), K (8), V (8)], 3 groups: Q, K and V each one
    matrix over all groups, orthogonalised and scaled by their own shapes."""
    g = torch.Generator().manual_seed(2)
    groups, split, cols = 3, (16, 8, 8), 24
    weight = torch.randn(groups * sum(split), cols, generator=g)
    grad = torch.randn(weight.shape, generator=g)
    qkv = weight.clone()
    settings = dict(lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=5,
                    precision="highest", scale_mode="spectral", coefficients="quintic")  # fmt: skip
    matrix = MuonMatrix(rows_split=split, groups=groups)
    _steps(Muon([qkv], **settings, matrices={qkv: matrix}), [qkv], [[grad]])
    per_group = grad.view(groups, sum(split), cols).split(list(split), dim=1)
    expected = []
    for part in per_group:
        flat = part.reshape(-1, cols)
        out = newton_schulz(flat, 5, "quintic", "highest") * scale_factor("spectral", *flat.shape)
        expected.append(out.reshape(part.shape))
    expected = weight - 0.1 * torch.cat(expected, dim=1).reshape(weight.shape)
    assert torch.allclose(qkv, expected, rtol=0, atol=1e-6)
    whole = weight.clone()  # not split: another update
    _steps(Muon([whole], **settings), [whole], [[grad]])
    assert (whole - qkv).abs().max() > 1e-3


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"momentum": 1.0}, "momentum 1.0 is not in"),
        ({"momentum": -0.1}, "momentum -0.1 is not in"),
        ({"ns_steps": 0}, "at least one Newton-Schulz step"),
        ({"scale_mode": "rms"}, "not one of"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Muon([torch.zeros(4, 4, requires_grad=True)], **settings)
    with pytest.raises(ValueError, match="2-D parameters"):
        Muon([torch.zeros(4, requires_grad=True)])


def _sharded_ns(rank, world, full, dim):
    import torch.distributed as dist

    from engine.optim.muon import TensorParallelShard

    def tp_sum(tensor):
        dist.all_reduce(tensor)

    shard = TensorParallelShard(dim, world, tp_sum)
    mine = full.chunk(world, dim=dim)[rank]
    return newton_schulz(mine, 5, "quintic", "highest", shard)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_distributed_tp_mode_gives_each_rank_its_part_of_the_whole_result(dim, shape):
    """--muon-tp-mode distributed: Newton-Schulz of each TP rank's shard, the Gram products
    and the norm summed over two gloo ranks, is the rank's part of the whole matrix's
    Newton-Schulz within fp32 rounding; the shards alone (blockwise) are not."""
    from tests.distributed import run_ranks

    full = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    whole = newton_schulz(full, 5, "quintic", "highest")
    parts = run_ranks(_sharded_ns, 2, full, dim)
    torch.testing.assert_close(torch.cat(parts, dim=dim), whole, rtol=0, atol=1e-5)
    alone = newton_schulz(full.chunk(2, dim=dim)[0], 5, "quintic", "highest")
    assert (alone - whole.chunk(2, dim=dim)[0]).abs().max() > 1e-2
