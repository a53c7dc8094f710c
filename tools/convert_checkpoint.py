"""Convert between our checkpoints, Hugging Face folders and Megatron-LM checkpoints.

  export:  --load SAVE_DIR [--iteration N] --output HF_DIR [--max-shard-size 5GB] [--dtype ...]
  import:  --from-hf HF_DIR --output SAVE_DIR --tensor-model-parallel-size N
           --pipeline-model-parallel-size M
  Megatron-LM:  --from-megatron CHECKPOINT_DIR_OR_ITER_DIR --output SAVE_DIR
                --load SAVE_DIR [--iteration N] --to-megatron --output CHECKPOINT_DIR
                [--tensor-model-parallel-size N]

Export writes config.json, generation_config.json, model.safetensors (sharded with an index
above --max-shard-size) and the training's tokenizer (or the one the tokenizer flags name),
loadable offline with transformers' AutoModelForCausalLM / AutoTokenizer: Llama-style models as
LlamaForCausalLM, GPT-2-style as GPT2LMHeadModel. Import writes iteration 0 of our checkpoint
with a fresh optimizer and keeps the folder's tokenizer; continue with `pretrain --load
SAVE_DIR --use-checkpoint-args`. Only safetensors, JSON and tokenizer files are read: no pickle.

--from-megatron reads a Megatron-LM torch_dist checkpoint of a megatron-core GPT model (any
TP/PP it was saved with; common.pt weights-only with an exact allow-list, .metadata with DCP's
classes only) into our checkpoint at Megatron-LM's iteration and consumed samples, with its
Adam state (per parameter, or the distributed optimizer's default dp_reshardable buckets;
without one, a fresh optimizer); continue with
`pretrain --load SAVE_DIR --use-checkpoint-args` and the same data flags.

--to-megatron writes our checkpoint as a Megatron-LM torch_dist checkpoint root (megatron-core's
GPT layout, loadable under any TP/PP; the vocabulary padded for --tensor-model-parallel-size):
the weights, the iteration, consumed samples and the model's arguments, no optimizer state.
Continue in Megatron-LM with `--load CHECKPOINT_DIR --no-load-optim --no-load-rng` (or
`--finetune` to start at iteration 0).
"""

from __future__ import annotations

import argparse

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.tokenizers.cli import (
    add_tokenizer_arguments,
    tokenizer_config,
    tokenizer_flags_given,
)
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", help="our checkpoint directory (export)")
    parser.add_argument("--iteration", type=int, help="which iteration (default: the latest)")
    parser.add_argument("--from-hf", help="a Hugging Face model folder (import)")
    parser.add_argument(
        "--from-megatron", help="a Megatron-LM torch_dist checkpoint (its root or iter_N folder)"
    )
    parser.add_argument(
        "--to-megatron",
        action="store_true",
        help="with --load: write a Megatron-LM torch_dist checkpoint instead of a HF folder",
    )
    parser.add_argument("--output", required=True, help="folder to write")
    parser.add_argument("--max-shard-size", default="5GB", help="export: safetensors shard size")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="export: tensor dtype (default: the training dtype)",
    )
    add_tokenizer_arguments(parser)  # export: the tokenizer (default: the training's)
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="export: skip comparing the checkpoint's files with their recorded checksums",
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument(
        "--no-load-optim",
        action="store_true",
        help="--from-megatron: leave Megatron-LM's optimizer state out (the run starts Adam "
        "afresh from the weights)",
    )
    args = parser.parse_args(argv)
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: a parallel size is 1 or more"
            )
    if args.no_load_optim and not args.from_megatron:
        raise ConfigError("--no-load-optim applies to --from-megatron only; drop it")
    if args.to_megatron and (
        args.dtype or tokenizer_flags_given(args) or args.pipeline_model_parallel_size != 1
    ):
        raise ConfigError(
            "--to-megatron writes the checkpoint's own dtype and tokenizer, with the stages "
            "in one checkpoint that Megatron-LM reads under any PP; drop --dtype, the "
            "tokenizer flags and --pipeline-model-parallel-size"
        )
    if args.to_megatron and not args.load:
        raise ConfigError("--to-megatron converts the checkpoint --load names; give --load")
    if sum(map(bool, (args.load, args.from_hf, args.from_megatron))) != 1:
        raise ConfigError(
            "give exactly one of --load (export to HF, or with --to-megatron to Megatron-LM), "
            "--from-hf or --from-megatron (import)"
        )
    if args.to_megatron:
        from engine.interop.megatron.export import export_to_megatron

        summary = export_to_megatron(
            args.load,
            args.output,
            args.iteration,
            tp=args.tensor_model_parallel_size,
            verify=not args.no_verify,
        )
        print(
            f"wrote {summary['checkpoint']} (iteration {summary['iteration']}, "
            f"{summary['tensors']} tensors) as a Megatron-LM torch_dist checkpoint; in "
            f"Megatron-LM: --load {args.output} --no-load-optim --no-load-rng"
        )
    elif args.from_megatron:
        from engine.interop.megatron.checkpoint import import_from_megatron

        summary = import_from_megatron(
            args.from_megatron,
            args.output,
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            load_optim=not args.no_load_optim,
        )
        print(
            f"imported {args.from_megatron} (iteration {summary['iteration']}, "
            f"{summary['tensors']} tensors) -> {summary['checkpoint']}; continue with --load "
            f"{args.output} --use-checkpoint-args"
        )
    elif args.load:
        from engine.interop.hf.export import export_to_hf

        summary = export_to_hf(
            args.load,
            args.output,
            args.iteration,
            args.max_shard_size,
            args.dtype,
            tokenizer_config(args) if tokenizer_flags_given(args) else None,
            verify=not args.no_verify,
        )
        print(
            f"exported {summary['checkpoint']} as {summary['architecture']}: "
            f"{summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB in "
            f"{summary['shards']} shard(s) -> {args.output}"
        )
        if summary.get("note"):
            print(f"note: {summary['note']}")
    else:
        from engine.interop.hf.import_hf import import_from_hf

        summary = import_from_hf(
            args.from_hf,
            args.output,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
        )
        print(
            f"imported {args.from_hf} ({summary['architecture']}, {summary['tensors']} "
            f"tensors) -> {summary['checkpoint']}; continue with --load {args.output} "
            "--use-checkpoint-args"
        )
    return 0


if __name__ == "__main__":
    run(main)
