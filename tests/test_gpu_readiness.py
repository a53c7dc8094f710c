"""What would break on the first GPU, checked on the CPU: each rank's device, GPUs kept away
from the CPU test ranks, the set-up leaving a machine's own torch in place, and the launch
script counting the GPUs torch may use."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from parallel.errors import ConfigError
from parallel.state import rank_device
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_rank_takes_the_gpu_of_its_local_rank():
    assert rank_device(None, 0, 1, 0) == torch.device("cpu")
    assert rank_device(None, 3, 4, 4) == torch.device("cuda", 3)
    assert rank_device("cuda", 1, 2, 8) == torch.device("cuda", 1)
    assert rank_device("cuda:1", 0, 1, 2) == torch.device("cuda", 1)
    assert rank_device("cpu", 5, 8, 8) == torch.device("cpu")


@pytest.mark.parametrize(
    "requested, local_rank, local_world, gpus, message",
    [
        (None, 4, 5, 4, "local rank 4 needs GPU 4, but 4 are visible"),
        ("cuda", 1, 2, 1, "start at most 1 processes per node"),
        ("cuda:0", 0, 2, 2, "--device cuda:0 puts all 2 ranks of a node on one GPU"),
        ("cuda", 0, 1, 0, "--device cuda, but no CUDA device is available"),
        ("tpu", 0, 1, 0, "--device tpu: give cpu or cuda"),
    ],
)
def test_a_rank_without_a_gpu_of_its_own_is_one_line(
    requested, local_rank, local_world, gpus, message
):
    with pytest.raises(ConfigError, match=message) as error:
        rank_device(requested, local_rank, local_world, gpus)
    assert "\n" not in str(error.value)


def _visible_devices(rank, world):
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("LOCAL_WORLD_SIZE")


def test_the_cpu_test_ranks_do_not_see_gpus():
    """The gloo ranks the tests start leave a machine's GPUs alone (on a GPU host they would
    otherwise each take, and collide on, GPU 0)."""
    assert run_ranks(_visible_devices, 2) == [("", "2"), ("", "2")]


def _fake_program(path, body: str) -> str:
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("has_torch", [True, False])
def test_the_set_up_leaves_an_importable_torch_in_place(tmp_path, has_torch):
    """`make` installs torch only where the venv cannot import one (a GPU machine's own CUDA
    build stays), and TORCH chooses the version."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    imports = "0" if has_torch else "1"
    _fake_program(
        venv / "bin" / "python",
        f'echo "$*" >> {log}\nif [ "$1" = -c ]; then exit {imports}; fi\nexit 0\n',
    )
    result = subprocess.run(
        ["make", "-C", ROOT, f"VENV={venv}", "TORCH=torch==2.11.0", "venv"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert "-c import torch" in calls
    installed = "-m pip install --quiet torch==2.11.0" in calls
    assert installed is not has_torch, calls
    assert not any("torch==2.13.0" in c for c in calls), calls


def test_the_launch_script_counts_the_gpus_torch_may_use(tmp_path):
    """examples/pretrain_gpt.sh sizes the run by what torch sees (CUDA_VISIBLE_DEVICES, a Slurm
    allocation), not by `nvidia-smi -L`, which lists every GPU of the machine."""
    bin_dir, log = tmp_path / "bin", tmp_path / "launch.log"
    bin_dir.mkdir()
    _fake_program(
        bin_dir / "nvidia-smi", 'for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: H100"; done\n'
    )
    python = _fake_program(
        tmp_path / "python",
        f'if [ "$1" = -m ]; then echo "$*" > {log}; exit 0; fi\nexec {sys.executable} "$@"\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": python}
    env.pop("NPROC_PER_NODE", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for this process, whatever the machine has
    result = subprocess.run(
        ["bash", "examples/pretrain_gpt.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    launched = log.read_text().split()
    assert launched[launched.index("--nproc-per-node") + 1] == "4"  # the CPU default
    assert "--bf16" not in launched


def _tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_gpu_check_lists_its_steps_and_says_in_one_line_that_there_is_no_gpu():
    listed = _tool("tools/gpu_check.py", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    names = [line.split(":")[0] for line in lines if not line.startswith("  to confirm by ")]
    confirmed_by = {line.split()[3].rstrip(":") for line in lines if line.startswith("  to con")}
    assert confirmed_by and confirmed_by <= set(names), confirmed_by  # each names a real step
    for step in ("environment", "gpu-tests", "fused-ops", "attention", "train-launch"):
        assert step in names
    assert {"throughput-125m", "throughput-350m", "throughput-1.3b", "vs-megatron"} <= set(names)
    assert "nccl-layouts" in names
    absent = _tool("tools/gpu_check.py")
    assert absent.returncode == 0 and len(absent.stdout.strip().splitlines()) == 1
    assert "no CUDA GPU" in absent.stdout
    unknown = _tool("tools/gpu_check.py", "--steps", "nonsense")
    assert unknown.returncode == 2 and "unknown nonsense" in unknown.stdout


def test_gpu_check_collects_the_gpu_marked_tests():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    files = gpu_check.gpu_test_files()
    assert "tests/test_fused_ops.py" in files and "tests/test_gpu_readiness.py" not in files


def test_gpu_check_report_lists_what_to_confirm_beside_the_steps_outcome(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    records = [{"name": "nccl-layouts", "what": "TP2", "command": "nccl", "outcome": "passed"}]
    md, _ = gpu_check.write_report(records, str(tmp_path / "r"), "a GPU")
    text = pathlib.Path(md).read_text()
    rows = [line for line in text.splitlines() if "run every schedule over NCCL" in line]
    assert rows == [
        "| pipeline transfers in the planned global order run every schedule over NCCL (2)"
        " | nccl-layouts | passed |"
    ]
    lines = text.splitlines()
    assert not any(line.startswith("| gpu-tests |") for line in lines)  # not run: no step row
    not_run = [line for line in lines if line.endswith(" | not run |")]
    assert len(not_run) == sum(step != "nccl-layouts" for _, step in gpu_check.TO_CONFIRM)


def test_gpu_benchmarks_run_on_the_cpu_with_tiny_shapes(tmp_path):
    """The scripts make gpu-check runs, checked end to end on small shapes (no GPU here)."""
    fused = _tool("tools/bench_fused_ops.py", "--tiny", "--json", str(tmp_path / "f.json"))
    assert fused.returncode == 0, fused.stdout + fused.stderr
    rows = {r["op"]: r for r in json.loads((tmp_path / "f.json").read_text())["rows"]}
    assert set(rows) == {"rms_norm", "layer_norm", "rotary", "swiglu", "cross_entropy"}
    for row in rows.values():  # the kernels' reference implementation through the fused glue
        assert row["fused_err"] < 1e-5 and row["compiled_err"] < 1e-5, row
    probe = _tool("tools/probe_attention.py", "--tiny", "--json", str(tmp_path / "a.json"))
    assert probe.returncode == 0, probe.stdout + probe.stderr
    kinds = {r["path"]: r["kind"] for r in json.loads((tmp_path / "a.json").read_text())["rows"]}
    assert kinds["MHA bf16 dropout 0.1"] == "math" and kinds["MHA fp32"] != "failed"


def test_the_nccl_layout_check_runs_its_layouts_and_needs_two_gpus(tmp_path, monkeypatch):
    """tools/nccl_parity.py (gpu-check's NCCL step) run with both sides on CPU: the runs it
    launches train, and their losses compare equal; without two GPUs it says so and exits 0,
    and gpu-check skips the step with that reason."""
    out = tmp_path / "n.json"
    # one of its layouts (each is two launches; the layouts themselves are tested on gloo ranks
    # in their own test files)
    layouts = ("--layouts", "dp2-ep2-moe")
    done = _tool("tools/nccl_parity.py", "--cpu-only", *layouts, "--iters", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["iterations"], r["max_rel_diff"]) for r in rows] == [
        ("dp2-ep2-moe", 2, 0.0)
    ]
    absent = _tool("tools/nccl_parity.py")
    assert absent.returncode == 0 and "needs 2 CUDA GPUs, this machine has 0" in absent.stdout
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    step = next(s for s in gpu_check.steps() if s.name == "nccl-layouts")
    monkeypatch.setattr(gpu_check, "_gpu_count", lambda: 1)  # whatever this machine has
    record = gpu_check.run_step(step, str(tmp_path), 1.0, 600)
    assert record["outcome"] == "skipped: needs 2 GPUs, this machine has 1"


def test_bench_throughput_reports_a_failing_variant_as_a_row(tmp_path):
    """A variant that cannot run (here: the fused kernels on a CPU) is a row of the table, and
    the others are still measured, each attempt in a process of its own."""
    out = tmp_path / "t.json"
    done = _tool(
        "tools/bench_throughput.py", "--tiny", "--variants", "fused", "torch", "--json", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert "needs a CUDA device" in runs["fused"]["error"]
    assert runs["torch"]["tokens_per_s"] > 0 and runs["torch"]["micro_batch"] == 2
    assert "fused            failed:" in done.stdout


def test_a_rank_without_gradients_builds_its_norm_on_its_device():
    """NCCL refuses CPU tensors: the norm's partial sum is made on the rank's device even when
    the rank has no gradient to take it from ("meta" stands in for a GPU here)."""
    from parallel.grads import squared_norm

    meta = torch.device("meta")
    assert squared_norm([], meta).device == meta
    assert squared_norm([torch.ones(4)], meta).device == meta
    assert squared_norm([torch.ones(4)], torch.device("cpu")).item() == 4.0


def test_collectives_refuse_tensors_their_backend_cannot_move():
    from parallel.comm import device_problem

    on_cpu = torch.ones(2)
    assert "NCCL collective was handed a tensor on cpu" in device_problem("nccl", (on_cpu,))
    assert device_problem("gloo", (on_cpu,)) is None
    assert device_problem("nccl", (torch.empty(2, device="meta"),)) is not None


def test_async_save_stages_the_state_in_one_host_block_and_copies_it_exactly():
    """One host allocation (pinned on GPUs) for every tensor, not one per tensor rounded up;
    the copy reproduces each tensor (box shards of a sharded tensor too) bit for bit."""
    from engine.checkpoint.staging import HostStaging
    from parallel.checkpoint.dcp import BoxTensor

    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(7, 5, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
        "half": torch.randn(13, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "sharded": BoxTensor(
            (6, 3),
            torch.float32,
            [((0, 0), torch.randn(2, 3, generator=g)), ((4, 0), torch.ones(2, 3))],
        ),
        "non_contiguous": torch.randn(4, 6, generator=g).t(),
    }
    staging = HostStaging(state, torch.device("cpu"))
    host = staging.copy_from(state, staging.mark_ready())
    storages = set()
    for key, value in host.items():
        views = [t for _, t in value.boxes] if isinstance(value, BoxTensor) else [value]
        sources = [t for _, t in state[key].boxes] if isinstance(value, BoxTensor) else [state[key]]
        for view, source in zip(views, sources, strict=True):
            assert view.dtype == source.dtype and view.shape == source.shape
            assert torch.equal(view, source)
            if view.numel():
                storages.add(view.untyped_storage().data_ptr())
                assert view.data_ptr() % 64 == 0  # each view aligned for any dtype
    assert storages == {staging.block.untyped_storage().data_ptr()}
    assert staging.matches(state)
    assert not staging.matches({**state, "w": torch.zeros(7, 6)})


def test_rope_tables_live_on_the_model_device_and_are_made_once_per_length():
    """No host-to-device copy of the inverse frequencies per forward, and the cos/sin tables
    reused by every micro-batch of a length ("meta" stands in for a GPU)."""
    from engine.model import BuildContext, GPTModel
    from engine.model.rope import RotaryEmbedding
    from tests.harness import tiny_config

    assert RotaryEmbedding(64, device="meta").inv_freq.device.type == "meta"
    cfg = tiny_config("llama")
    model = GPTModel(cfg, BuildContext(cfg))
    tokens = torch.randint(0, 300, (2, cfg.seq_length))
    first = model._rotary(cfg.seq_length, tokens.device)
    loss = model(tokens, labels=tokens).sum()
    assert model._rotary(cfg.seq_length, tokens.device) is first
    assert model._rotary(cfg.seq_length // 2, tokens.device)[0].shape[0] == cfg.seq_length // 2
    assert torch.equal(model(tokens, labels=tokens).sum(), loss)  # a new length, then back


def test_launcher_gives_the_ranks_expandable_segments_unless_the_user_chose():
    from engine.launch import allocator_environment

    assert allocator_environment({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert allocator_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}


def test_each_rank_draws_only_its_slice_with_the_full_weights_values():
    """Item 16: a weight's element is a function of the parameter's seed and its position, so
    a rank draws its slice alone (on its device) and every TP layout holds the TP=1 values:
    stacked q/k/v rows, split columns, a padded vocabulary (zero padding), positions past
    2^32; the hash is lowbias32 bit for bit (numpy's uint32 as the reference), and the draws
    are normal (mean, std, neighbours uncorrelated)."""
    from parallel.tensor_parallel.init import draw_local, hash32, normal_init
    from parallel.tensor_parallel.sharding import REPLICATED, local_from_full, split_sharding

    init = normal_init(0.02)
    full = draw_local((96, 40), REPLICATED, init, 1234)
    for tp in (2, 4):
        for rank in range(tp):
            qkv = split_sharding(0, [32, 32, 32], rank, tp)
            assert torch.equal(draw_local((96, 40), qkv, init, 1234), local_from_full(full, qkv))
            columns = split_sharding(1, [40], rank, tp)
            cut = local_from_full(full, columns)
            assert torch.equal(draw_local((96, 40), columns, init, 1234), cut)
    padded = draw_local((100, 40), split_sharding(0, [100], 1, 2), init, 1234, drawn_rows=96)
    assert torch.equal(padded[:46], full[50:96]) and not padded[46:].any()
    assert not torch.equal(draw_local((96, 40), REPLICATED, init, 1235), full)

    bits = np.arange(-(2**20), 2**20, 7).astype(np.int64).astype(np.uint32)
    expected = bits.copy()
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        expected ^= expected >> np.uint32(shift)
        expected *= np.uint32(factor)
    expected ^= expected >> np.uint32(16)
    assert np.array_equal(hash32(torch.from_numpy(bits.view(np.int32))).numpy().view(np.uint32),
                          expected)  # fmt: skip

    wide = (299_520, 16384)  # 4.9e9 elements in all: a 512th, whose positions cross 2^32
    values = draw_local(wide, split_sharding(0, [wide[0]], 448, 512), init, 5).double()
    assert values.shape == (585, 16384)
    third = draw_local(wide, split_sharding(0, [wide[0]], 1344, 1536), init, 5)  # same rows
    assert torch.equal(third.double(), values[:195])
    assert abs(values.mean()) < 1e-4 and abs(values.std() / 0.02 - 1) < 2e-3
    flat = values.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]) < 2e-3


def test_the_plain_cross_entropy_keeps_no_fp32_copy_of_the_logits(monkeypatch):
    """Item 12: the PyTorch-ops cross-entropy saves the logits as they are (bf16 here) for
    backward, not an fp32 softmax, and works in fp32 pieces (a small CE_CHUNK forces several):
    loss, log-sum-exp and gradient match a float64 reference, padding columns excluded."""
    from parallel.tensor_parallel import layers

    monkeypatch.setattr(layers, "CE_CHUNK", 64)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 40, generator=generator).bfloat16().requires_grad_()
    target = torch.randint(0, 36, (5, 3), generator=generator)
    saved = []

    def keep(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, lse = layers.vocab_parallel_cross_entropy(
            logits, target, None, vocab_size=36, return_logsumexp=True
        )
    assert (torch.float32, logits.numel()) not in saved
    assert max(numel for _, numel in saved) == logits.numel()
    (loss.sum() + 0.5 * lse.sum()).backward()
    reference = logits.detach().double().requires_grad_()
    masked = reference.masked_fill(torch.arange(40) >= 36, float("-inf"))
    ref_lse = torch.logsumexp(masked, dim=-1)
    ref_loss = ref_lse - masked.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (ref_loss.sum() + 0.5 * ref_lse.sum()).backward()
    assert torch.allclose(loss.double(), ref_loss, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.double(), reference.grad, atol=1e-2)
    assert not logits.grad[..., 36:].any()
    fp32 = torch.randn(4, 40, generator=generator, requires_grad=True)  # pieces are views here
    kept = fp32.detach().clone()
    layers.vocab_parallel_cross_entropy(fp32, target[:4, 0], None).sum().backward()
    assert torch.equal(fp32.detach(), kept)
    expected = torch.softmax(kept.double(), -1) - torch.nn.functional.one_hot(target[:4, 0], 40)
    assert torch.allclose(fp32.grad.double(), expected, atol=1e-6)


def test_each_layer_runs_the_attention_kernel_chosen_for_it():
    """Item 10: the kernel is chosen when the model is built (FlexAttention for windows on GPUs,
    K/V expanded for fp32 grouped-query attention on GPUs, a mask made once per length
    elsewhere) and each gives the math reference's result (FlexAttention forward only: it has
    no CPU backward); the start-up line names each layer's."""
    import warnings

    from engine.model.attention_kernel import (
        AttentionKernel,
        AttentionMasks,
        choose_kernel,
        describe,
    )

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_kernel(cuda, torch.bfloat16, True, 4096, 0.0) == "flex-window"
    assert choose_kernel(cuda, torch.bfloat16, True, 4096, 0.1) == "sdpa-mask"
    assert choose_kernel(cpu, torch.float32, False, 4096, 0.0) == "sdpa-mask"
    assert choose_kernel(cuda, torch.float32, True, None, 0.0) == "sdpa-expanded"
    assert choose_kernel(cuda, torch.bfloat16, True, None, 0.0) == "sdpa-causal"
    assert choose_kernel(cpu, torch.float32, True, None, 0.0) == "sdpa-causal"
    assert describe(["sdpa-causal"] * 3 + ["flex-window"], [4, 5, 6, 7]) == (
        "layers 4-6: sdpa-causal; 7: flex-window"
    )

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 16, generator=generator)
    k, v = (torch.randn(2, 2, 64, 16, generator=generator) for _ in range(2))

    def reference(window):
        keys, values = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = q @ keys.transpose(-1, -2) / 4.0
        back = torch.arange(64)[:, None] - torch.arange(64)[None, :]
        allowed = (back >= 0) & (back <= (window if window is not None else 64))
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values

    masks = AttentionMasks()  # one per model: two layers of each kind share it
    for kind, window in (("sdpa-causal", None), ("sdpa-expanded", None), ("sdpa-mask", 8),
                         ("flex-window", 8)):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention's eager-mode notice
            for _ in range(2):
                out = AttentionKernel(kind, window, True, masks)(q, k, v, 0.0)
        assert torch.allclose(out, reference(window), atol=1e-5), kind
    assert sorted(key[0] for key in masks.masks) == ["flex-window", "sdpa-mask"]
