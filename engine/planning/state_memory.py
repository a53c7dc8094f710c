"""Bytes of model state a rank holds: parameters, gradients and optimizer state, counted from
the storages of the tensors themselves (each storage once; a released one holds 0 bytes), and
the formula for each data-parallel sharding strategy (parallel/data_parallel/ddp.py);
`live_tensor_bytes` counts every tensor alive in the process, whoever holds it, so that a copy
the engine does not list (a leak) shows beside the listed state.

Formula, bytes per parameter with bf16 parameters, fp32 main grads and fp32 masters + Adam's
two moments (12 bytes), over d data-parallel ranks:

    no_shard 2 + 4 + 12 = 18     optim 2 + 4 + 12/d     optim_grads 2 + 16/d
    optim_grads_params 18/d

Muon's weights hold 8 bytes of state (fp32 master and momentum) in place of Adam's 12.
"""

from __future__ import annotations

import torch

KINDS = ("params", "grads", "optimizer")


def formula_bytes_per_param(strategy: str, dp: int, state: int = 12) -> dict[str, float]:
    """Bytes per parameter by kind for bf16 training with Adam (module docstring; `state`:
    the optimizer's bytes per parameter unsharded, 8 for Muon's master and momentum)."""
    params = 2 / dp if strategy == "optim_grads_params" else 2
    grads = 4 / dp if strategy in ("optim_grads", "optim_grads_params") else 4
    optimizer = state if strategy == "no_shard" else state / dp
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _tensors_by_kind(ddps, optimizer) -> dict[str, list[torch.Tensor]]:
    params, grads = [], []
    for ddp in ddps:
        params += list(ddp.params)
        grads += [p.main_grad for p in ddp.params] + [p.grad for p in ddp.params]
        for buffer in ddp.buffers:
            params += [b.data for b in buffer.buckets] + [buffer.param_shard_buffer]
            grads += [b.grad for b in buffer.buckets] + [buffer.grad_shard_buffer]
    state = [p.master for p in optimizer.pieces]
    for entry in optimizer.optimizer.state.values():
        state += [v for v in entry.values() if torch.is_tensor(v)]
    return {"params": params, "grads": grads, "optimizer": state}


def held_state_bytes(ddps, optimizer) -> dict[str, int]:
    """{kind: bytes} this rank holds now; a storage shared by two kinds (fp32 masters that are
    the parameters themselves) counts once, under the first."""
    seen: set[int] = set()
    out = {}
    for kind, tensors in _tensors_by_kind(ddps, optimizer).items():
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[kind] = total
    return out


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of every storage on `device_type` that a live tensor (a Python object the garbage
    collector sees) views, each storage once."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, ReferenceError):  # (tensors without storage, dead proxies)
            continue
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
