"""FP8 training (engine/ops/fp8/) through the engine: a tensor-, pipeline- and data-parallel FP8
run against one process's, MoE experts in FP8 under expert parallelism, --fp8-param-gather,
torchao's GEMMs under TP, a resumed delayed-scaling run bit for bit, which layers stay in high
precision, and tools/bench_fp8.py. The numerics of the recipes and GEMMs: tests/test_fp8.py."""

from __future__ import annotations

import json

import pytest
import torch

from engine.ops.fp8.recipe import RECIPES
from tests.checkpoint_tensors import checkpoint_tensors
from tests.distributed import run_ranks


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


def _follows_one_process(dataset_prefix, tokenizer_model, tmp_path, fp8: dict, world: int,
                         layout: dict) -> dict[int, float]:  # fmt: skip
    """One process with the FP8 flags `fp8` (logging to one.jsonl) and `world` ranks with
    `layout` too (many.jsonl) within the layouts' bounds: 1e-5 at the first step, 5e-5 at every
    step. Returns one process's losses."""
    from tests.test_training import losses, pretrain

    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one", **fp8))
    pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, "many", **fp8, **layout))
    one, many = losses(tmp_path / "one.jsonl"), losses(tmp_path / "many.jsonl")
    assert sorted(one) == sorted(many) == list(range(1, 6))
    apart = [abs(many[s] - one[s]) / one[s] for s in one]
    assert apart[0] < 1e-5 and max(apart) < 5e-5, apart
    return one


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
    world, layout = LAYOUTS[recipe]
    one = _follows_one_process(dataset_prefix, tokenizer_model, tmp_path, fp8, world, layout)
    if recipe == "delayed":
        pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "plain"))
        plain = losses(tmp_path / "plain.jsonl")
        from_fp32 = [abs(one[s] - plain[s]) / plain[s] for s in range(2, 6)]
        assert max(from_fp32) > 1e-5 and max(from_fp32) < 0.01  # FP8 ran, and trains as fp32


def test_fp8_experts_under_expert_parallelism_follow_one_process(
    dataset_prefix, tokenizer_model, tmp_path
):
    """An MoE model's experts in FP8, each with its own scales (one after the other: they have
    biases), under data x expert parallelism (DP2 x EP2, the weights gathered in FP8, the
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
    states = [
        checkpoint_tensors(str(tmp_path / f"{name}-ckpt"), 5, "fp8/") for name in ("one", "ep2")
    ]
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


def _loaded_weights(rank, world, argv: list[str], path: str, load_optimizer: bool) -> dict:
    """{fc weight name: (the weight, its optimizer master)} after `path` is read into a run of
    `argv` (one process), with or without the optimizer's state."""
    from engine.pretrain import parse
    from engine.train.checkpoint import read_into_model
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    run = setup(prepare(parse(argv), world), ParallelState.build(1, 1))
    read_into_model(run, path, load_optimizer=load_optimizer, load_rng=True)
    out = {}
    for name, param in run.chunks[0].module.named_parameters():
        if ".mlp.linear_fc" in name and name.endswith("weight"):
            pieces = sorted((p for p in run.optimizer.pieces if p.param is param),
                            key=lambda p: p.offset)  # fmt: skip
            master = torch.cat([p.master.reshape(-1) for p in pieces]).view_as(param)
            out[name] = (param.detach().clone(), master.clone())
    return out


def test_fp8_experts_grouped_compute_what_each_expert_computes(
    dataset_prefix, tokenizer_model, tmp_path
):
    """FP8 experts (no biases) under EP2 with the distributed optimizer: with
    --moe-grouped-gemm (each projection of all experts one autograd function,
    engine/ops/fp8/grouped.py; on the CPU its products each expert's in turn) the losses equal
    those of the experts run one by one, bit for bit, under delayed scaling (every expert's
    own amaxes recorded) with the weights gathered in FP8."""
    from tests.test_moe_training import MOE
    from tests.test_training import losses, pretrain

    moe = MOE | {"--moe-layer-freq": "1", "--fp8-format": "hybrid", "--fp8-amax-history-len": "2",
                 "--expert-model-parallel-size": "2", "--disable-bias-linear": True,
                 "--fp8-param-gather": True}  # fmt: skip
    for name, grouped in (("grouped", True), ("each", None)):
        flags = moe | {"--moe-grouped-gemm": grouped}
        pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, name, **flags))
    grouped, each = losses(tmp_path / "grouped.jsonl"), losses(tmp_path / "each.jsonl")
    assert sorted(each) == list(range(1, 6)) and grouped == each


def _readers_take_masters(ckpt: str, tmp_path, masters: dict) -> None:
    """A --fp8-param-gather run's Hugging Face and Megatron-LM exports and the weights
    evaluation reads (load_model_weights) hold its masters (what the optimizer trained, in the
    weights' dtype: `masters`, fc2's weights by name), not the FP8 values of its model/
    weights."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from engine.checkpoint.files import iteration_dir, read_meta
    from engine.checkpoint.load import load_model_weights
    from engine.config.model import ModelConfig
    from engine.interop.hf.export import export_to_hf
    from engine.interop.megatron.export import export_to_megatron
    from engine.model import BuildContext, GPTModel

    path = iteration_dir(ckpt, 5)
    export_to_hf(ckpt, str(tmp_path / "hf"), dtype="float32")
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    export_to_megatron(ckpt, str(tmp_path / "megatron"))
    folder = iteration_dir(str(tmp_path / "megatron"), 5)  # (our own output: DCP reads it)
    key = "decoder.layers.mlp.linear_fc2.weight"
    entry = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata[key]
    megatron = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    dcp.load(megatron, checkpoint_id=folder, no_dist=True)
    cfg = ModelConfig.from_record(read_meta(path)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    weights = dict(model.named_parameters())
    for name, master in masters.items():
        layer = int(name.split(".")[1])
        read = {
            "hf": hf[f"transformer.h.{layer}.mlp.c_proj.weight"].t(),  # (GPT-2's Conv1D)
            "megatron": megatron[key][layer],
            "evaluation": weights[name].detach(),
        }
        for reader, value in read.items():
            assert torch.equal(value.to(master.dtype), master), (reader, name)


def test_fp8_param_gather_computes_what_the_run_without_it_does(
    dataset_prefix, tokenizer_model, tmp_path
):
    """--fp8-param-gather under TP2 x DP2 with the distributed optimizer (tensorwise: each
    weight's scale from its whole amax, reduced over the shards and TP) follows one process
    without it within
    the layouts' bounds; its FP8 layers' weights hold FP8 values (at most 255 distinct values
    a tensor, one scale each), their masters not; a delayed-scaling run with it resumes bit
    for bit (the weights published again from the masters read)."""
    from tests.test_training import straight_and_resumed

    fp8 = {"--fp8-format": "hybrid", "--fp8-recipe": "tensorwise"}
    ckpt = str(tmp_path / "gather-ckpt")
    gather = {"--use-distributed-optimizer": True, "--fp8-param-gather": True,
              "--tensor-model-parallel-size": "2", "--save": ckpt,
              "--save-interval": "5"}  # fmt: skip
    _follows_one_process(dataset_prefix, tokenizer_model, tmp_path, fp8, 4, gather)
    weights = checkpoint_tensors(ckpt, 5, "model/")
    fp8_weights = [k for k in weights if ".linear_" in k and ".weight" in k]
    assert len(fp8_weights) == 2 * 6  # q, k, v, the projection, fc1 and fc2 of each layer
    assert all(weights[k].unique().numel() <= 255 for k in fp8_weights)
    masters = checkpoint_tensors(ckpt, 5, "optim/")
    masters = {k[6:-7]: v for k, v in masters.items() if ".weight/master" in k and "_fc" in k}
    assert len(masters) == 4 and all(m.unique().numel() > 1000 for m in masters.values())
    _readers_take_masters(ckpt, tmp_path, {k: v for k, v in masters.items() if "_fc2" in k})
    # read into one process without the flag (fp32: each master is the weight itself): the
    # weights are the checkpoint's masters, not its FP8 weights, with or without the
    # optimizer's state (--finetune); with the flag and the first layer kept in high precision
    # (its master the weight, the last layer's apart): the same
    from engine.checkpoint.files import iteration_dir

    path = iteration_dir(ckpt, 5)
    for extra, load_optimizer in (
        ({}, True),
        ({}, False),
        (
            {
                "--fp8-param-gather": True,
                "--use-distributed-optimizer": True,
                "--first-last-layers-bf16": True,
                "--num-layers-at-end-in-bf16": "0",
            },
            True,
        ),
    ):
        argv = _args(dataset_prefix, tokenizer_model, tmp_path, "read", **fp8, **extra)
        loaded = run_ranks(_loaded_weights, 1, argv, path, load_optimizer)[0]
        assert sorted(loaded) == sorted(masters)
        for name, (weight, master) in loaded.items():
            assert torch.equal(master, masters[name]), name
            in_fp8 = extra and name.startswith("layers.1.")
            assert torch.equal(weight, master) != bool(in_fp8), name

    delayed = {"--fp8-format": "hybrid", "--fp8-amax-history-len": "2",
               "--use-distributed-optimizer": True, "--fp8-param-gather": True}  # fmt: skip

    def args_of(name, **extra):
        return _args(dataset_prefix, tokenizer_model, tmp_path, name, **delayed, **extra)

    straight, resumed = straight_and_resumed(args_of, tmp_path, 3)
    assert resumed == straight and sorted(straight) == list(range(1, 6))


def test_fp8_param_gather_under_blockwise_scales_each_block_over_the_shards(
    dataset_prefix, tokenizer_model, tmp_path
):
    """--fp8-param-gather with blockwise under TP2 x DP2: each 128 x 128 block's scale from its
    amax over the data-parallel shards (which cut blocks), the forward's and backward's blocks
    made again from the gathered values: the run follows one process without the flag within
    the layouts' bounds, and each block of its FP8 weights holds FP8 values of one scale."""
    from engine.ops.fp8.quantize import E4M3, block_amax, scale_from_amax
    from engine.ops.fp8.recipe import Fp8Recipe

    # (fc1 [512, 64] and fc2 [64, 512]: two blocks of 128 x 128 in each TP rank's half)
    blockwise = {"--fp8-format": "e4m3", "--fp8-recipe": "blockwise", "--ffn-hidden-size": "512"}
    ckpt = str(tmp_path / "ckpt")
    gather = {"--use-distributed-optimizer": True, "--fp8-param-gather": True,
              "--tensor-model-parallel-size": "2", "--save": ckpt,
              "--save-interval": "5"}  # fmt: skip
    _follows_one_process(dataset_prefix, tokenizer_model, tmp_path, blockwise, 4, gather)
    rule = Fp8Recipe(recipe="blockwise").rule
    weights = checkpoint_tensors(ckpt, 5, "model/")
    fc = {k: v for k, v in weights.items() if ".mlp.linear_fc" in k and k.endswith(".weight")}
    assert len(fc) == 4
    blocks = 0
    for key, weight in fc.items():  # (the TP halves' blocks are the whole weight's)
        scale = scale_from_amax(block_amax(weight, (128, 128)), E4M3, rule)
        for row, col in [(r, c) for r in range(scale.shape[0]) for c in range(scale.shape[1])]:
            block = weight[row * 128 : (row + 1) * 128, col * 128 : (col + 1) * 128]
            scaled = block * scale[row, col]
            assert torch.equal(scaled.to(E4M3).float(), scaled), (key, row, col)
            blocks += 1
    assert blocks == 2 * (4 + 4)


SAME_GEMMS = {
    "bf16-pp2-virtual": (4, {"--bf16": True, "--num-layers": "4",
                             "--pipeline-model-parallel-size": "2",
                             "--num-layers-per-virtual-pipeline-stage": "1"}),
    "optimizer-instances": (4, {"--num-distributed-optimizer-instances": "2"}),
    "sharded-muon": (2, {"--optimizer": "dist_muon", "--lr": "0.02"}),
    # delayed scaling over a skipped step (an injected NaN gradient at step 2): the weights'
    # amaxes of the step after it count in the max over the history as without the flag
    "delayed-skipped-step": (2, {"--fp8-recipe": "delayed", "--fp8-amax-history-len": "2",
                                 "--fp8-amax-compute-algo": "max"}),
}  # fmt: skip


@pytest.mark.parametrize("layout", SAME_GEMMS)
def test_fp8_param_gather_gives_the_gemms_what_they_had_without_it(
    layout, dataset_prefix, tokenizer_model, tmp_path
):
    """The distributed optimizer with bf16 weights under PP2 x DP2 with two virtual chunks per
    stage, with two optimizer instances over DP4, with Muon sharded over DP2, and delayed
    scaling over a step the optimizer skips (without the skipped step's weight amax recorded
    again, step 5 is 1.3e-5 apart): the same run
    with and without --fp8-param-gather gives the same losses bit for bit (each FP8 GEMM sees
    the same bytes: the weights' FP8 values quantise back to the bytes the run without the
    flag makes from its weights). Without gradient clipping: the FP8 weights' buffer of their
    own changes the order in which the gradient norm's squares are added (1e-8 apart at step
    4 with clipping on)."""
    from tests.test_training import losses, pretrain

    world, extra = SAME_GEMMS[layout]
    flags = {"--fp8-format": "hybrid", "--fp8-recipe": "tensorwise",
             "--use-distributed-optimizer": True, "--clip-grad": "0", **extra}  # fmt: skip
    env = {"TRIPOD_FAULT_NAN_GRAD_AT": "2"} if "skipped" in layout else None
    pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, "plain", **flags), env)
    ckpt = str(tmp_path / "ckpt")
    flagged = flags | {"--fp8-param-gather": True, "--save": ckpt, "--save-interval": "5"}
    pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, "gather", **flagged), env)
    plain, gather = losses(tmp_path / "plain.jsonl"), losses(tmp_path / "gather.jsonl")
    assert sorted(plain) == list(range(1, 6)) and gather == plain
    if "--bf16" in extra:  # the exports: the fp32 masters in the weights' bf16
        masters = checkpoint_tensors(ckpt, 5, "optim/")
        masters = {k[6:-7]: v.bfloat16() for k, v in masters.items() if k.endswith("/master")}
        masters = {k: v for k, v in masters.items() if ".linear_fc2.weight" in k}
        assert len(masters) == 4
        _readers_take_masters(ckpt, tmp_path, {k: v for k, v in masters.items() if "_fc2" in k})


def _gathered_fp8_weights(rank, world, argv: list[str]) -> tuple[bool, float]:
    """(whether every FP8 weight as its unit's forward sees it, gathered from the sharded
    parameters, is E4M3 values times its gather's scale; the share of this rank's shards of
    them that is)."""
    from engine.pretrain import parse
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    run = setup(prepare(parse(argv), world), ParallelState.build(1, 1))
    chunk = run.chunks[0]
    linears = [m for m in chunk.module.modules() if getattr(m, "fp8", None) is not None]
    seen = {}

    def is_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Whether each value comes back from its E4M3 quantisation at `scale`."""
        values = values.float().reshape(-1)
        scaled = values * scale.reshape(())
        return scaled.to(torch.float8_e4m3fn).float() * (1.0 / scale.reshape(())) == values

    def record(module, args):
        seen[module] = is_fp8(module.weight.detach(), module.fp8.gathered_scale).all()

    hooks = [linear.register_forward_pre_hook(record) for linear in linears]
    with torch.no_grad():
        chunk(torch.randint(0, 100, (2, 32)))
    for hook in hooks:
        hook.remove()
    held = [
        is_fp8(flat, linear.fp8.gathered_scale)
        for linear in linears
        for _, _, flat in chunk.held_pieces(linear.weight)
    ]
    assert len(seen) == len(linears) == 8 and held
    return all(seen.values()), float(torch.cat(held).float().mean())


def test_fp8_param_gather_with_sharded_parameters_follows_one_process(
    dataset_prefix, tokenizer_model, tmp_path
):
    """--fp8-param-gather under Megatron-FSDP's optim_grads_params, TP2 x DP2: each unit's FP8
    weights gathered as E4M3 bytes with the scales made after the step; the run follows one
    process without the flag within the layouts' bounds. The weights a unit's forward sees are
    FP8 values; the shards the ranks keep are not. A delayed-scaling run resumes bit for bit."""
    from tests.test_training import straight_and_resumed

    fp8 = {"--fp8-format": "hybrid", "--fp8-recipe": "tensorwise"}
    fsdp = {"--use-megatron-fsdp": True, "--fp8-param-gather": True,
            "--data-parallel-sharding-strategy": "optim_grads_params"}  # fmt: skip
    tp2 = fsdp | {"--tensor-model-parallel-size": "2"}
    _follows_one_process(dataset_prefix, tokenizer_model, tmp_path, fp8, 4, tp2)
    argv = _args(dataset_prefix, tokenizer_model, tmp_path, "look", **fp8, **fsdp)
    for gathered_in_fp8, held_share in run_ranks(_gathered_fp8_weights, 2, argv):
        assert gathered_in_fp8 and held_share < 0.5, held_share
    delayed = {"--fp8-format": "hybrid", "--fp8-amax-history-len": "2", **fsdp}

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
