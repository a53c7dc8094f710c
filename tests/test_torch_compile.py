"""--torch-compile: transformer layers compiled with torch.compile (inductor, on CPU here) train
as the eager single-process reference does, under TP2 x DP2 with sequence parallelism and
sharded parameters (whose gathers run in hooks around the compiled forward), from one graph:
every layer reuses the first layer's (no recompile per layer) and nothing breaks it (the TP
linears' communication is traced, the weight gradients come out of the graph)."""

from __future__ import annotations

from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    engine_run,
    full_params,
    model_error,
    opt_config,
    reference_run,
    tiny_config,
)


def _compiled(rank, world):
    import torch._dynamo

    state = ParallelState.build(tp=2)
    cfg, ocfg = tiny_config("llama"), opt_config()
    ref_losses, _, ref_params, initial = reference_run(cfg, ocfg, 3, 8)
    torch._dynamo.utils.counters.clear()
    outputs, ddps, _ = engine_run(
        state,
        cfg,
        ocfg,
        3,
        8,
        2,
        sharding="optim_grads_params",
        overlap=True,
        sequence_parallel=True,
        torch_compile=True,
    )
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    breaks = sorted(str(reason).splitlines()[0] for reason in counters["graph_break"])
    errors = model_error(full_params(ddps, state), ref_params, initial)
    loss_err = max(abs(o.loss - r) / r for o, r in zip(outputs, ref_losses, strict=True))
    return errors, loss_err, graphs, breaks


def test_compiled_layers_match_the_eager_reference():
    for errors, loss_err, graphs, breaks in run_ranks(_compiled, 4, timeout=900):
        assert graphs == 1, graphs  # four layers, one graph: not recompiled per layer
        assert breaks == [], breaks
        assert errors["moved"] > 0.01, errors
        assert errors["model"] < 1e-6 and errors["worst_tensor"] < 1e-5, errors
        assert loss_err < 1e-6, loss_err


def test_compiled_layers_with_documents_compile_once():
    """--torch-compile with --reset-attention-mask --reset-position-ids: each micro-batch's
    documents differ, yet the layers compile once (attention within documents runs outside
    the graph) and give the eager model's loss and gradients."""
    import torch
    import torch._dynamo

    from engine.data.documents import Packing
    from engine.model import BuildContext, GPTModel

    cfg = tiny_config("llama", seq_length=32)
    compiled, eager = (GPTModel(cfg, BuildContext(cfg, seed=1)) for _ in range(2))
    for layer in compiled.layers.values():
        layer.forward = torch.compile(layer.forward)
    packing = Packing(0, reset_position_ids=True, reset_attention_mask=True)
    torch._dynamo.utils.counters.clear()
    graphs = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(1, 300, (2, 32), generator=gen)
        tokens[tokens < 40] = 0  # documents of random lengths, new ones every micro-batch
        batch = packing.annotate({"tokens": tokens, "labels": tokens})
        kwargs = {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"]}
        losses = [m(tokens, tokens, **kwargs).mean() for m in (compiled, eager)]
        for loss in losses:
            loss.backward()
        assert abs(losses[0].item() - losses[1].item()) < 1e-6
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1], graphs  # nothing recompiled after the first micro-batch
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() < 1e-5, name
