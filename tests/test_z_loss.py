"""--z-loss-coeff: the model adds c x logsumexp(logits)^2 per token beside the cross-entropy, the
logsumexp over the real vocabulary (padding rows left out) and over the tensor-parallel ranks'
shards of it: its value and every gradient equal the same terms written out with torch on the
full logits, at TP 1 and TP 2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import BuildContext, GPTModel
from parallel.state import ParallelState
from parallel.tensor_parallel.sharding import full_from_local, tp_sharding_of
from tests.distributed import rel_err, run_ranks
from tests.harness import VOCAB, tiny_config

COEFF = 1e-2


def _run(rank, world):
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(4))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cfg = tiny_config("llama", z_loss_coeff=COEFF)
    # written out: the cross-entropy and the z-term from the full logits, one process
    reference = GPTModel(cfg, BuildContext(cfg, seed=3))
    logits = reference.full_logits(reference(inputs)).float()
    lse = torch.logsumexp(logits, dim=-1)
    expected_z = COEFF * lse.square()
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    (ce.mean() + expected_z.mean()).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    # the engine's, at TP `world`
    state = ParallelState.build(tp=world)
    ctx = BuildContext(cfg, seed=3, tp_group=state.tp_group, tp_size=state.tp_size)
    model = GPTModel(cfg, ctx, tp_rank=state.tp_rank)
    loss, z = model(inputs, labels)
    (loss.mean() + z.mean()).backward()
    from parallel.tensor_parallel.layers import all_reduce_partial_grads

    all_reduce_partial_grads(model.parameters(), state.tp_group)
    errors = {}
    for name, param in model.named_parameters():
        full = full_from_local(param.grad, tp_sharding_of(param), state.tp_group)
        rows = expected[name].shape[0]  # (the padded vocabulary's rows get none)
        errors[name] = rel_err(full[:rows] if full.dim() else full, expected[name])
    return rel_err(z.detach(), expected_z.detach()), rel_err(loss.detach(), ce.view(2, 16)), errors


def test_z_loss_value_and_gradients_at_tp1_and_tp2():
    for world in (1, 2):
        for z_err, ce_err, grads in run_ranks(_run, world):
            assert z_err < 1e-5 and ce_err < 1e-5, (world, z_err, ce_err)
            assert len(grads) > 10 and max(grads.values()) < 1e-5, (world, grads)
