"""Megatron-LM's own example scripts' flag sets through examples/pretrain_gpt.sh: GPT-3 175B
(examples/gpt3/train_gpt3_175b_distributed.sh), Llama-3 8B in its bf16 branch with its mock
data and with its real-data arguments (examples/llama/train_llama3_8b_h100_fp8.sh), and
Mixtral 8x7B (examples/mixtral/train_mixtral_8x7b_distributed.sh), as of Megatron-LM's main
branch in 2026.

Each script's argument arrays are restated below as the scripts build them: every flag and
value verbatim except the sizes (layers, widths, sequence length, batch sizes, run lengths,
intervals and parallel sizes, each marked with the script's value), the paths, and
--log-jsonl added to read the run. They are expanded unquoted by bash, as the scripts expand
them, so their word splitting (a quoted "--split '99,1,0'" element, a schedule string) is
what the engine sees. The Mixtral script's MoE flags are refused in one line naming MoE; the
rest of that script trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.config.tokenizer import TokenizerConfig
from engine.data.prepare.preprocess import preprocess
from tests.cli import CPU_ONLY
from tests.test_training import ROOT, records
from tests.tokenizer_files import copy_gpt2_files, make_hf_folder

GPT3 = """
GPT_MODEL_ARGS=(
    --num-layers 4  # 96
    --hidden-size 64  # 12288
    --num-attention-heads 4  # 96
    --seq-length 64  # 2048
    --max-position-embeddings 64  # 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8  # 1536
    --step-batch-size-schedule "0:2 256:4 512:8"  # "0:16 2.4B:320 ... 12B:1536"
    --train-iters 6  # 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 5  # 430000
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2  # 8
    --pipeline-model-parallel-size 2  # 16
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1  # 100
    --save-interval 3  # 10000
    --eval-interval 3  # 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2  # 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)
NPROC_PER_NODE=4 bash examples/pretrain_gpt.sh \\
    ${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]} \\
    ${EVAL_AND_LOGGING_ARGS[@]} --log-jsonl $LOG
"""

LLAMA3 = """
MODEL_ARGS=(
    --use-mcore-models
    --num-layers 2  # 32
    --hidden-size 64  # 4096
    --ffn-hidden-size 224  # 14336
    --num-attention-heads 4  # 32
    --group-query-attention
    --num-query-groups 2  # 8
    --kv-channels 16  # 128
    --seq-length 64  # 8192
    --max-position-embeddings 64  # 8192
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4  # 128
    --train-samples 28  # 1953125000
    --lr-decay-samples 24  # 1949218748
    --lr-warmup-samples 4  # 3906252
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4      # Specific to decoupled AdamW, ensure optimizer is compatible
    --decoupled-min-lr 4.5e-5  # Specific to decoupled AdamW
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel  # Always enable sequence parallelism with TP_SIZE=2
)
DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")
if [[ "$TOKENIZER_ARG" == "MOCK" ]]; then
    DATA_ARGS_LIST=(
        "--mock-data"
        "--tokenizer-type NullTokenizer"
        "--vocab-size 4096"  # 128256
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--tiktoken-pattern v2"
        "--split '99,1,0'"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
    )
else
    DATA_ARGS_LIST=(
        "--data-path $DATA_ARG"
        "--tokenizer-type HuggingFaceTokenizer"
        "--tokenizer-model $TOKENIZER_ARG"
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--split '99,1,0'"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
        "--vocab-size 4096"  # 128256
    )
fi
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 2  # 32
    --eval-interval 4  # 100
    --save-interval 4  # 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
NPROC_PER_NODE=2 bash examples/pretrain_gpt.sh \\
    ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS_LIST[@]} \\
    ${EVAL_AND_LOGGING_ARGS[@]} --log-jsonl $LOG
"""

MIXTRAL = """
MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64  # 4096
    --max-position-embeddings 128  # 32768
    --num-layers 4  # 32
    --hidden-size 64  # 4096
    --ffn-hidden-size 224  # 14336
    --num-attention-heads 4  # 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2  # 8
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)
DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4  # 256
    --lr 1e-4
    --train-iters 6  # 500000
    --lr-decay-iters 4  # 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1  # 500
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2  # 4
    --expert-model-parallel-size ${EP:-2}  # 8
    --use-distributed-optimizer
    --sequence-parallel
)
LOGGING_ARGS=(
    --log-interval 1 \\
    --save-interval 3 \\
    --eval-interval 3 \\
    --eval-iters 2 \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \\
    --no-load-optim \\
    --no-load-rng
)
NPROC_PER_NODE=4 bash examples/pretrain_gpt.sh \\
    ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${DATA_ARGS[@]} ${TRAINING_ARGS[@]} \\
    ${MODEL_PARALLEL_ARGS[@]} ${LOGGING_ARGS[@]} --log-jsonl $LOG
"""


@pytest.fixture(scope="module")
def data(corpus, tokenizer_model, dataset_prefix, tmp_path_factory) -> dict:
    """A GPT-2 BPE and a Hugging Face tokenizer trained on the corpus, each with the corpus
    preprocessed by it; the SentencePiece model and its dataset for Mixtral's Llama2Tokenizer."""
    root = tmp_path_factory.mktemp("megatron-scripts")
    hf = make_hf_folder(corpus["jsonl"], str(root / "hf"))
    vocab, merges = copy_gpt2_files(hf, str(root / "gpt2"))
    gpt2 = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf_config = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf)
    for name, tokenizer in (("gpt2", gpt2), ("hf", hf_config)):
        preprocess(corpus["jsonl"], str(root / name), tokenizer, append_eod=True, progress=False)
    return {
        "VOCAB_FILE": vocab,
        "MERGE_FILE": merges,
        "GPT2_DATA": str(root / "gpt2_text_document"),
        "HF_TOKENIZER": hf,
        "HF_DATA": str(root / "hf_text_document"),
        "TOKENIZER_MODEL": tokenizer_model,
        "DATA_PATH": dataset_prefix,
    }


def run_script(body: str, env: dict, tmp_path) -> subprocess.CompletedProcess:
    log = tmp_path / "log.jsonl"
    variables = {
        "CHECKPOINT_PATH": str(tmp_path / "checkpoints"),
        "TENSORBOARD_LOGS_PATH": str(tmp_path / "tensorboard"),
        "DATA_CACHE_PATH": str(tmp_path / "cache"),
        "LOG": str(log),
        **env,
    }
    script = tmp_path / "script.sh"
    script.write_text("set -euo pipefail\n" + body)
    environment = dict(
        os.environ,
        **CPU_ONLY,
        **variables,
        PYTHON=sys.executable,
        PYTHONPATH=ROOT,
    )
    environment.pop("MASTER_PORT", None)  # torchrun's --standalone picks a free port
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=600,
    )


def trained(result, tmp_path, iterations: int) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = [r for r in records(tmp_path / "log.jsonl") if "split" not in r]
    assert [r["iteration"] for r in found] == list(range(1, iterations + 1))
    assert all(r["lm_loss"] is not None and r["lm_loss"] > 0 for r in found)
    latest = (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()
    assert int(latest) == iterations
    return found


def test_gpt3_175b_script(data, tmp_path):
    env = {
        "DATA_PATH": data["GPT2_DATA"],
        "VOCAB_FILE": data["VOCAB_FILE"],
        "MERGE_FILE": data["MERGE_FILE"],
    }
    result = run_script(GPT3, env, tmp_path)
    found = trained(result, tmp_path, 6)
    # the step schedule: 4 samples (256 tokens) at 2 a step, then 4 to 8 samples, then 8
    assert [r["batch_size"] for r in found] == [2, 2, 4, 8, 8, 8]
    assert "Megatron-LM flags accepted without effect here: --attention-backend" in result.stdout


@pytest.mark.parametrize("data_kind", ["mock", "real"])
def test_llama3_8b_script_bf16_branch(data, data_kind, tmp_path):
    env = {"TOKENIZER_ARG": "MOCK", "DATA_ARG": "MOCK"}
    if data_kind == "real":
        env = {"TOKENIZER_ARG": data["HF_TOKENIZER"], "DATA_ARG": data["HF_DATA"]}
    result = run_script(LLAMA3, env, tmp_path)
    found = trained(result, tmp_path, 7)  # 28 samples, 4 a step
    assert [r["consumed_samples"] for r in found] == [4 * k for k in range(1, 8)]
    trace = tmp_path / "torch_profile"
    assert sorted(os.listdir(trace)) == ["rank-0.json.gz", "rank-1.json.gz"]
    line = next(x for x in result.stdout.splitlines() if "accepted without effect" in x)
    for flag in ("--use-mcore-models", "--cross-entropy-loss-fusion", "--ckpt-format"):
        assert flag in line


def test_mixtral_8x7b_script_trains_with_expert_parallelism(data, tmp_path):
    """Megatron-LM's Mixtral 8x7B script at a small size on 4 ranks: PP 2, the 8 experts
    spread over 2 expert-parallel ranks folded out of DP 2, the distributed optimizer with
    overlapped reductions and gathers; the script's own EP 8 does not fold into a pipeline
    stage of 2 ranks and is refused in one line, the checkpoint left as it was."""
    env = {"TOKENIZER_MODEL": data["TOKENIZER_MODEL"], "DATA_PATH": data["DATA_PATH"]}
    result = run_script(MIXTRAL, env, tmp_path)
    trained(result, tmp_path, 6)
    meta = json.loads((tmp_path / "checkpoints" / "iter_0000006" / "meta.json").read_text())
    assert meta["model"]["num_experts"] == 8 and meta["model"]["moe_router_topk"] == 2
    layout = meta["layout"]
    assert (layout["pp"], layout["dp"], layout["ep"], layout["distributed_optimizer"]) == (
        2,
        2,
        2,
        True,
    )
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    refused = run_script(MIXTRAL, env | {"EP": "8"}, tmp_path)
    assert refused.returncode == 2
    lines = [x for x in (refused.stdout + refused.stderr).splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert "expert-model-parallel-size 8 does not divide the 2 ranks" in lines[0], lines
    assert sorted(os.listdir(tmp_path / "checkpoints")) == saved
