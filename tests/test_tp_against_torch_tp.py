"""Every gradient of a tensor-parallel step against an independent reference: the same
transformers model, parallelised with torch's own `torch.distributed.tensor.parallel` (the
embedding split over the vocabulary, the output layer's logits left split and the cross-entropy
computed on them by `loss_parallel`), and imported into ours at TP 2. No custom backward of ours
is on the reference side: transformers' modules and DTensor's rules make its gradients."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.hf.architectures import hf_tensors, style_of
from engine.interop.hf.import_hf import import_from_hf
from tests.distributed import rel_err, run_ranks
from tests.test_hf import _random_hf_model

VOCAB = 2000


def _torch_tp_gradients(folder: str, tokens: torch.Tensor) -> tuple[float, dict]:
    """transformers' model at TP 2 by torch's tensor parallelism: the loss and every gradient,
    full, by transformers' parameter name."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(model.config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    logits = model(tokens[:, :-1]).logits
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return loss.item(), grads


def _our_gradients(ckpt: str, tokens: torch.Tensor, sp: bool) -> tuple[float, dict]:
    """Ours at TP 2 (SP on or off): the loss and every gradient, put together into
    transformers' tensors by the export's own name map."""
    from engine.model.builder import build_model_chunks
    from parallel.state import ParallelState
    from parallel.tensor_parallel.layers import all_reduce_partial_grads
    from parallel.tensor_parallel.sharding import full_from_local, tp_sharding_of

    state = ParallelState.build(tp=2)
    path = iteration_dir(ckpt, 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    model = build_model_chunks(
        cfg, state, sequence_parallel=sp, gradient_accumulation_fusion=False
    )[0]
    load_model_weights(path, model)
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    all_reduce_partial_grads(model.parameters(), state.tp_group)
    logical = {}
    for name, param in model.named_parameters():
        sharding = tp_sharding_of(param)
        full = full_from_local(param.grad, sharding, state.tp_group)
        if sharding.replicated or len(sharding.names) <= 1:
            logical[name] = full
            continue
        for part, suffix in zip(
            full.split(list(sharding.chunks), dim=sharding.dim), sharding.names, strict=True
        ):
            logical[f"{name}{suffix}"] = part
    grads = {}
    for tensor in hf_tensors(cfg, style_of(cfg)):
        joined = torch.cat([logical[part] for part in tensor.parts], dim=0)
        grads[tensor.name] = joined.t() if tensor.transpose else joined
    return loss.item(), grads


def _compare(rank, world, folder, ckpt, tokens):
    loss, theirs = _torch_tp_gradients(folder, tokens)
    out = []
    for sp in (False, True):
        our_loss, ours = _our_gradients(ckpt, tokens, sp)
        errors = {}
        for name, expected in theirs.items():
            got = ours.get(name)
            if got is None:
                errors[name] = "missing"
                continue
            if got.shape[0] > expected.shape[0]:  # our vocabulary padding
                assert got[expected.shape[0] :].abs().max() == 0, f"{name}: padding got gradient"
                got = got[: expected.shape[0]]
            errors[name] = rel_err(got, expected)
        out.append({"sp": sp, "loss": abs(our_loss - loss) / loss, "grads": errors})
    return out


@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_every_gradient_equals_torch_tensor_parallel_on_transformers(tmp_path, style):
    _random_hf_model(style, tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), 2, 1)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    for rank_results in run_ranks(
        _compare, 2, str(tmp_path / "hf"), str(tmp_path / "ours"), tokens
    ):
        for result in rank_results:
            assert result["loss"] < 1e-6, result
            grads = result["grads"]
            # embeddings, output layer, final norm and, in each of the 4 layers, 9 tensors (4 of
            # attention, 3 of the MLP, 2 norms; qwen2 adds 3 biases): none left out
            assert len(grads) == 3 + 4 * (9 + 3 * (style == "qwen2")), sorted(grads)
            bad = {n: e for n, e in grads.items() if not (isinstance(e, float) and e < 1e-5)}
            assert not bad, (result["sp"], bad)  # "missing", NaN or too far
