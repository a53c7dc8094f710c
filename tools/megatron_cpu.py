"""megatron-core 0.16.1 on a CPU: the stand-ins for what it asks of CUDA at run time, for the
tests and tools that run megatron-core beside tripod (tools/bench_vs_megatron.py, the Megatron-LM
checkpoint and optimizer tests). Each replaces exactly what is named, in the process that calls
it (a rank of its own: nothing of tripod's runs patched), and nothing here is used by
`engine/` or `parallel/`. On a GPU megatron-core runs without them.
"""

from __future__ import annotations

import torch

# megatron-core's TransformerConfig on the CPU: weights made on the CPU, no fused kernels (each
# needs CUDA, apex or Transformer Engine), no dropout
CPU_CONFIG = dict(
    use_cpu_initialization=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
)


def cuda_queries_on_cpu() -> None:
    """What megatron-core's model asks CUDA while building and running on the CPU:
    torch.cuda.current_device (the rotary table, tensor-parallel and pipeline buffers are put
    there), torch.cuda.synchronize (around the checkpoint writer and batched p2p transfers),
    and the CUDA RNG state its model-parallel RNG tracker saves and restores around dropout
    (torch.cuda.get_rng_state and megatron's own getter and setter), all answered by the CPU.
    The causal mask must be passed in: its default is made on "cuda"."""
    import megatron.core.tensor_parallel.random as megatron_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def cuda_tensors_on_cpu() -> None:
    """The tensors megatron-core's optimizer, DDP wrapper and schedules create with
    device="cuda" (torch.tensor, zeros, empty, ...: counters, norms, token counts) made on the
    CPU instead. Process-wide: keep it out of processes that time or test tripod."""
    for name in ("tensor", "zeros", "empty", "ones", "full", "zeros_like", "empty_like"):
        original = getattr(torch, name)

        def on_cpu(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        setattr(torch, name, on_cpu)


def cuda_type_names() -> None:
    """Tensor.type() names CPU tensors as CUDA ones (megatron-core's optimizers check
    parameters by that name: 'torch.cuda.FloatTensor', ...), and Tensor.cuda() leaves a tensor
    where it is (the tied embedding's copy under pipeline parallelism)."""
    original = torch.Tensor.type

    def type_name(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.")

    torch.Tensor.type = type_name
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def router_without_transformer_engine() -> None:
    """moe_utils.te_general_gemm, a name the MoE router's gate reads that is left undefined
    without Transformer Engine, set to None: the router's own fallback (a plain matmul) runs."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def norms_for_sequence_parallelism() -> None:
    """megatron-core's norm without apex or Transformer Engine (torch_norm.WrappedTorchNorm)
    refuses sequence parallelism: apex's FusedLayerNorm, a CUDA kernel, is what marks a
    norm's weights `sequence_parallel` so that finalize_model_grads sums their gradients over
    the tensor-parallel group. This builds torch's norm as before and marks them the same way."""
    import dataclasses

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def build(cls, config, hidden_size, eps=1e-5, **kwargs):
        without = dataclasses.replace(config, sequence_parallel=False)
        norm = original(cls, without, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = build


class _HostStream:
    """In place of a CUDA stream on the CPU, where every copy is done when it returns."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> _HostEvent:
        return _HostEvent()


class _HostEvent:
    def synchronize(self) -> None:
        pass


def alltoall_dispatcher_on_cpu() -> None:
    """The MoE all-to-all token dispatcher copies its split sizes to the host on a side CUDA
    stream, as numpy arrays, and waits for an event on it: the stream is a host stand-in whose
    waits return at once, it is also the current stream (so no copy is made "on the side"),
    entering a stream does nothing, and a CPU tensor asked for as numpy is handed on as numpy
    (megatron's copy returns a CPU tensor as it is, which all_to_all_single does not take as
    split sizes)."""
    import contextlib

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    stream = _HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
