"""Hugging Face export and import: transformers gives the engine's logits and greedy tokens,
round trips are bit-identical, and a transformers model imported under TP2 x PP2 gives
transformers' logits."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import numpy as np
import pytest
import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights, read_tensors
from engine.config.model import ModelConfig
from engine.config.tokenizer import TokenizerConfig
from engine.data.builder import build_gpt_datasets
from engine.data.sources import data_sources
from engine.data.tokenizers.sentencepiece import SentencePieceTokenizer
from engine.errors import ConfigError
from engine.eval.generate import greedy_generate
from engine.interop.hf.export import export_to_hf
from engine.interop.hf.import_hf import import_from_hf
from engine.model import BuildContext, GPTModel
from parallel.checkpoint.dcp import SafeFileSystemReader
from tests.cli import run_tool
from tests.distributed import rel_err, run_ranks
from tests.test_training import base_args, pretrain

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_FLAGS = {
    "--position-embedding-type": "rope",
    "--normalization": "RMSNorm",
    "--swiglu": True,
    "--disable-bias-linear": True,
    "--group-query-attention": True,
    "--num-query-groups": "2",
    "--untie-embeddings-and-output-weights": True,
    # as Megatron-LM's Llama-3 example: the export adds the 1 its norms apply
    "--apply-layernorm-1p": True,
}
GPT2_FLAGS = {"--openai-gelu": True}
# Qwen2 (q, k, v biases) with Llama 3.x RoPE scaling, and Qwen3 (per-head q/k norms), tied
QWEN2_FLAGS = {k: v for k, v in LLAMA_FLAGS.items() if k != "--apply-layernorm-1p"}
QWEN2_FLAGS |= {"--add-qkv-bias": True, "--use-rope-scaling": True}
QWEN2_FLAGS |= {"--rope-scaling-original-max-position-embeddings": "16"}
QWEN3_FLAGS = {k: v for k, v in LLAMA_FLAGS.items() if k != "--untie-embeddings-and-output-weights"}
QWEN3_FLAGS |= {"--qk-layernorm": True}
# Mistral (a sliding window) with YaRN, trained with the sequence split over 2 CP ranks
MISTRAL_FLAGS = dict(LLAMA_FLAGS, **{"--window-size": "(11, 0)"})
MISTRAL_FLAGS |= {"--position-embedding-type": "yarn", "--rotary-scaling-factor": "4"}
MISTRAL_FLAGS |= {"--yarn-original-max-position-embeddings": "16"}
STYLE_FLAGS = {
    "gpt2": GPT2_FLAGS,
    "llama": LLAMA_FLAGS,
    "qwen2": QWEN2_FLAGS,
    "qwen3": QWEN3_FLAGS,
    "mistral": MISTRAL_FLAGS,
}
TP2_PP2 = {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}
LAYOUTS = {"mistral": {"--context-parallel-size": "2", "--pipeline-model-parallel-size": "2"}}


@pytest.fixture(scope="module")
def trained(dataset_prefix, tokenizer_model, tmp_path_factory):
    """Tiny models of every style trained for a few steps under TP2 x PP2 (Mistral under
    CP2 x PP2)."""
    out = {}
    for style, flags in STYLE_FLAGS.items():
        ckpt = str(tmp_path_factory.mktemp(f"trained-{style}") / "ckpt")
        pretrain(
            4,
            base_args(
                dataset_prefix,
                tokenizer_model,
                **flags,
                **LAYOUTS.get(style, TP2_PP2),
                **{
                    "--train-iters": "8",
                    "--lr-warmup-iters": "1",
                    "--save": ckpt,
                    "--hidden-dropout": "0.0",
                    "--attention-dropout": "0.0",
                },
            ),
        )
        out[style] = ckpt
    return out


def engine_model(ckpt: str) -> GPTModel:
    path = iteration_dir(ckpt, find_latest(ckpt))
    cfg = ModelConfig(**read_meta(path)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    return model.eval()


@pytest.mark.parametrize("style", list(STYLE_FLAGS))
def test_transformers_matches_the_engine(trained, tokenizer_model, tmp_path, style):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    summary = export_to_hf(trained[style], str(out), max_shard_size="100KB")
    assert summary["shards"] > 1 and (out / "model.safetensors.index.json").exists()
    assert {p.suffix for p in out.iterdir()} <= {".json", ".safetensors", ".model"}  # no pickle
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (
        type(hf).__name__
        == {
            "gpt2": "GPT2LMHeadModel",
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
        }[style]
    )
    ours = engine_model(trained[style])
    tokens = torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.full_logits(ours(tokens=tokens))
        got = hf(tokens).logits
    assert got.shape == expected.shape == (2, 24, 2000)
    assert rel_err(got, expected) < 1e-4 and (got - expected).abs().max() < 1e-4 * 50
    prompt = tokens[0, :6].tolist()
    ours_greedy = greedy_generate(ours, prompt, 12)
    hf.generation_config.eos_token_id = None  # no early stop: compare 12 tokens each
    hf_greedy = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=3
    )[0].tolist()
    assert ours_greedy == hf_greedy
    tokenizer = AutoTokenizer.from_pretrained(out)
    if style == "qwen2":  # transformers overrides the class tokenizer_config.json names
        from transformers import LlamaTokenizer

        assert type(tokenizer).__name__ == "Qwen2Tokenizer" and "Qwen2Tokenizer" in summary["note"]
        tokenizer = LlamaTokenizer.from_pretrained(out)
    text = "def main(argv):\n    return 0\n"
    assert tokenizer.encode(text, add_special_tokens=False) == SentencePieceTokenizer(
        tokenizer_model
    ).tokenize(text)
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 3


def _model_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, whole, read in one pass."""
    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in stored.items()
        if k.startswith("model/")
    }
    read_tensors(path, tensors)
    return tensors


def test_ours_to_hf_to_ours_is_bit_identical(trained, tmp_path):
    for style, ckpt in trained.items():
        export_to_hf(ckpt, str(tmp_path / f"{style}-hf"))
        import_from_hf(str(tmp_path / f"{style}-hf"), str(tmp_path / f"{style}-back"), 2, 2)
        original = _model_tensors(iteration_dir(ckpt, 8))
        back = _model_tensors(iteration_dir(str(tmp_path / f"{style}-back"), 0))
        assert original.keys() == back.keys()
        # A model trained with --apply-layernorm-1p comes back as a plain one whose norm
        # weights are the 1 + weight it applied.
        shifted = "--apply-layernorm-1p" in STYLE_FLAGS[style]
        for key, value in original.items():
            if shifted and key.endswith("layernorm.weight"):
                value = (value.float() + 1).to(value.dtype)
            assert torch.equal(value, back[key]), key
        assert not shifted or any(k.endswith("layernorm.weight") for k in original)


# Hugging Face families made at random by transformers: the Llama family's members (Llama 3.x
# RoPE scaling included, tied and untied) and GPT-2.
HF_STYLES = [
    "gpt2",
    "llama",
    "llama3-scaled",
    "llama-yarn",
    "llama-dynamic",
    "mistral",
    "qwen2",
    "qwen3-tied",
]


def _random_hf_model(style: str, folder):
    import transformers

    torch.manual_seed(0)
    if style == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=4, n_head=4, vocab_size=2000, n_positions=64
        )
        model = transformers.GPT2LMHeadModel(config)
        model.save_pretrained(folder)
        return model.eval()
    shape = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=2000,
        max_position_embeddings=64,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if style == "llama3-scaled":  # Llama 3.2's scaling, its original length shrunk to fit
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope |= {"original_max_position_embeddings": 16}
    if style == "llama-yarn":  # its original length shorter than the tokens
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
        rope |= {"original_max_position_embeddings": 16}
    if style == "llama-dynamic":  # 16 tokens run past max_position_embeddings 8
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
        shape["max_position_embeddings"] = 8
    family = {"qwen3-tied": "qwen3"}.get(style, style.split("-")[0])
    family = "llama" if family == "llama3" else family
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    extra = {"sliding_window": 6} if style == "mistral" else {}  # shorter than the tokens
    config = config_class(
        **shape,
        rope_parameters=rope,
        tie_word_embeddings=style.endswith("tied"),
        head_dim=16,
        **extra,
    )
    model = model_class(config)
    with torch.no_grad():  # norms and biases away from their initial values, so they count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


def test_hf_to_ours_to_hf_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    for style in HF_STYLES:
        _random_hf_model(style, tmp_path / f"{style}-hf")
        import_from_hf(str(tmp_path / f"{style}-hf"), str(tmp_path / f"{style}-ours"), 2, 2)
        export_to_hf(str(tmp_path / f"{style}-ours"), str(tmp_path / f"{style}-again"))
        original = load_file(tmp_path / f"{style}-hf" / "model.safetensors")
        again = load_file(tmp_path / f"{style}-again" / "model.safetensors")
        if style == "gpt2" or style.endswith("tied"):
            original.pop("lm_head.weight", None)  # the tied copy, if transformers saved it
        assert original.keys() == again.keys(), style
        for key, value in original.items():
            assert torch.equal(value, again[key]), (style, key)


def test_exported_files_get_the_mode_of_a_new_file(tokenizer_model, tmp_path):
    """Exported under umask 027, every file (shards, index, configs, tokenizer) is 0640, as any
    new file would be: neither safetensors' own 0600 nor a fixed 0644 passes."""
    _random_hf_model("llama", tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    out = tmp_path / "again"
    old = os.umask(0o027)
    try:
        export_to_hf(
            str(tmp_path / "ours"),
            str(out),
            max_shard_size="100KB",
            tokenizer=TokenizerConfig(tokenizer_model=tokenizer_model),
        )
    finally:
        os.umask(old)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "tokenizer.model" in names
    modes = {name: oct(stat.S_IMODE((out / name).stat().st_mode)) for name in names}
    assert modes == {name: oct(0o666 & ~0o027) for name in names}


def _tp2_pp2_logits(rank, world, ckpt, tokens):
    from engine.model.builder import build_model_chunks
    from parallel.pipeline.p2p import P2P
    from parallel.state import ParallelState

    state = ParallelState.build(tp=2, pp=2)
    path = iteration_dir(ckpt, 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    model = build_model_chunks(cfg, state)[0].eval()
    load_model_weights(path, model)
    p2p = P2P(state, (tokens.shape[1], tokens.shape[0], cfg.hidden_size), torch.float32)
    with torch.no_grad():
        if state.is_first_stage:
            p2p.send_forward(model(tokens=tokens))
            return None
        return model.full_logits(model(hidden=p2p.recv_forward()))


@pytest.mark.parametrize("style", HF_STYLES)
def test_transformers_model_imported_under_tp2_pp2(tmp_path, style):
    hf = _random_hf_model(style, tmp_path / "hf")
    ckpt = str(tmp_path / "ours")
    import_from_hf(str(tmp_path / "hf"), ckpt, 2, 2)
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    results = run_ranks(_tp2_pp2_logits, 4, ckpt, tokens)
    for logits in results[2:]:  # the last pipeline stage
        assert rel_err(logits, expected) < 1e-5


def test_training_continues_from_an_imported_model(dataset_prefix, tokenizer_model, tmp_path):
    """The imported model's first training loss is transformers' loss of the same model on the
    run's first global batch (read with the dataset builder megatron-core's order is tested
    against), so an import that scrambled a weight, or a run that ignored --load, fails."""
    hf = _random_hf_model("llama", tmp_path / "hf")
    ckpt = str(tmp_path / "ours")
    import_from_hf(str(tmp_path / "hf"), ckpt, 1, 2)
    log = tmp_path / "log.jsonl"
    pretrain(
        2,
        base_args(
            dataset_prefix,
            tokenizer_model,
            **{
                "--load": ckpt,
                "--use-checkpoint-args": True,
                "--pipeline-model-parallel-size": "2",
                "--train-iters": "2",
                "--lr-warmup-iters": "1",
                "--log-jsonl": str(log),
                "--num-layers": "2",
                "--hidden-dropout": "0",
                "--attention-dropout": "0",
                "--seed": "1234",
            },
        ),
    )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records if "split" not in r] == [1, 2]
    train = build_gpt_datasets(
        data_sources([dataset_prefix], "90,10,0"), 32, 1234, (16, 8, 0), str(tmp_path / "idx")
    )[0]
    batch = torch.from_numpy(np.stack([train[i] for i in range(8)]).astype(np.int64))
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    expected = expected.item()  # the mean over the 8 x 32 tokens
    first = records[0]["lm_loss"]
    assert abs(first - expected) < 1e-5 * expected, (first, expected)


def test_options_without_an_equivalent_are_errors(trained, tmp_path):
    cfg = ModelConfig(**read_meta(iteration_dir(trained["llama"], 8))["model"])
    from engine.interop.hf.architectures import style_of

    cfg = dataclasses.replace(cfg, qk_layernorm=True)
    assert style_of(cfg) == "qwen3"
    cfg = dataclasses.replace(cfg, add_qkv_bias=True)
    with pytest.raises(ConfigError, match="--add-qkv-bias has no equivalent in Qwen3ForCausal"):
        style_of(cfg)
    cfg = ModelConfig(**read_meta(iteration_dir(trained["gpt2"], 8))["model"])
    cfg = dataclasses.replace(cfg, qk_layernorm=True)
    with pytest.raises(ConfigError, match="--qk-layernorm has no equivalent in GPT2LMHeadModel"):
        style_of(cfg)
    cfg = dataclasses.replace(cfg, qk_layernorm=False, untie_embeddings_and_output_weights=True)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel ties them"):
        style_of(cfg)


def test_cli(trained, tmp_path):
    hf = str(tmp_path / "hf")
    result = run_tool("convert_checkpoint.py", "--load", trained["llama"], "--output", hf)
    assert result.returncode == 0 and "exported" in result.stdout, result.stderr
    result = run_tool("hf_generate.py", "--model", hf, "--prompt", "def ", "--max-new-tokens", "5")
    assert result.returncode == 0 and "LlamaForCausalLM" in result.stdout, result.stderr
    missing, out = str(tmp_path / "nothing"), str(tmp_path / "x")
    result = run_tool("convert_checkpoint.py", "--load", missing, "--output", out)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_import_checks_every_shape_first_and_never_overwrites(tmp_path):
    """A safetensors file whose tensor does not fit config.json is refused before anything is
    written, and an existing output folder is never overwritten."""
    from safetensors.torch import load_file, save_file

    source = tmp_path / "llama-hf"
    _random_hf_model("llama", source)
    existing = tmp_path / "existing"
    result = run_tool("convert_checkpoint.py", "--from-hf", str(source), "--output", str(existing))
    assert result.returncode == 0, result.stderr
    before = {p: p.read_bytes() for p in existing.rglob("*") if p.is_file()}

    result = run_tool("convert_checkpoint.py", "--from-hf", str(source), "--output", str(existing))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "already exists and is not empty" in lines[0]

    tensors = load_file(source / "model.safetensors")
    name = "model.layers.2.mlp.up_proj.weight"
    tensors[name] = tensors[name][:96].clone()  # 96 rows where config.json says 128
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    for output in (existing, tmp_path / "fresh"):
        result = run_tool(
            "convert_checkpoint.py", "--from-hf", str(source), "--output", str(output)
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"tensor {name} has shape [96, 64], but config.json describes [128, 64]" in lines[0]
    assert not (tmp_path / "fresh").exists()
    assert not list(tmp_path.glob("fresh.tmp*"))
    assert {p: p.read_bytes() for p in existing.rglob("*") if p.is_file()} == before


def test_import_refuses_damaged_or_escaping_folders(tmp_path):
    """A sharded folder whose index points outside it, is not JSON, or whose shard is cut
    short, and a config.json without a field: each one InputError line, nothing written."""
    from engine.errors import InputError

    source = tmp_path / "hf"
    _random_hf_model("llama", source).save_pretrained(source, max_shard_size="200KB")
    (source / "model.safetensors").unlink()  # only the shards and their index remain
    index = source / "model.safetensors.index.json"
    original_index = index.read_text()
    shard = sorted(source.glob("model-*.safetensors"))[0]
    first = next(iter(json.loads(original_index)["weight_map"]))

    def escaping():
        data = json.loads(original_index)
        data["weight_map"][first] = "../elsewhere.safetensors"
        index.write_text(json.dumps(data))

    def not_json():
        index.write_text("{not json")

    def cut_shard():
        index.write_text(original_index)
        shard.write_bytes(shard.read_bytes()[:100])

    def no_field():
        config = json.loads((source / "config.json").read_text())
        del config["hidden_size"]
        (source / "config.json").write_text(json.dumps(config))

    cases = [
        (escaping, f"names '../elsewhere.safetensors', not a file of {source}"),
        (not_json, "not a safetensors index"),
        (cut_shard, f"{shard}: not a readable safetensors file"),
        (no_field, "config.json: a field is missing or malformed (KeyError: 'hidden_size')"),
    ]
    for number, (damage, message) in enumerate(cases):
        damage()
        output = tmp_path / f"out{number}"
        with pytest.raises(InputError) as info:
            import_from_hf(str(source), str(output))
        assert message in str(info.value) and "\n" not in str(info.value)
        assert not output.exists() and not list(tmp_path.glob(f"out{number}.tmp*"))
