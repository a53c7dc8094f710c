"""Every flag of Megatron-LM's training parser (core_v0.16.1 and core_v0.19.0, the lists in
engine/config/megatron/) has exactly one answer here, implemented flags keep Megatron-LM's
defaults, each kind of answer does what it says on a command line, and the migration report
reads flags and scripts."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engine.config.arguments import flag_of
from engine.config.configs import SECTIONS
from engine.config.megatron.answers import (
    DIFFERENT_DEFAULTS,
    MISSING,
    NO_EFFECT,
    NOT_APPLICABLE,
)
from engine.config.megatron.compat import table_answers
from engine.config.megatron.releases import RELEASES, megatron_flags, read_release
from engine.config.megatron.report import implemented_flags
from engine.errors import ConfigError
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.test_megatron_flags import SHAPE
from tests.test_training import ROOT


def _implemented_fields():
    for _, cls, _ in SECTIONS:
        if hasattr(cls, "add_arguments"):
            continue
        for field in dataclasses.fields(cls):
            if "help" in field.metadata:
                yield field


def test_both_releases_lists_are_read_whole():
    counts = {release: len(read_release(release)) for release in RELEASES}
    assert counts == {"core_v0.16.1": 700, "core_v0.19.0": 868}, counts
    assert len(megatron_flags()) == 896  # their union


def test_every_megatron_flag_has_exactly_one_answer():
    groups = [NO_EFFECT, MISSING, NOT_APPLICABLE]
    listed = [flag for table in groups for flags in table.values() for flag in flags]
    twice = sorted({flag for flag in listed if listed.count(flag) > 1})
    assert twice == [], twice
    implemented = implemented_flags()
    both = sorted(implemented & set(listed))
    assert both == [], both  # an implemented flag is not also in the table
    unanswered = sorted(set(megatron_flags()) - implemented - set(listed))
    assert unanswered == [], unanswered
    stray = sorted(set(listed) - set(megatron_flags()))
    assert stray == [], stray  # the table names only Megatron-LM's flags
    empty = [reason for table in groups for reason, flags in table.items() if not flags]
    assert empty == [], empty  # a reason wrapped onto a second line makes one without flags


def test_implemented_flags_keep_megatron_lm_defaults():
    definitions = megatron_flags()
    differ = {}
    for field in _implemented_fields():
        flag = flag_of(field)
        definition = definitions.get(flag)
        if definition is None or field.metadata.get("required") or flag in DIFFERENT_DEFAULTS:
            continue
        ours = field.default if field.default_factory is dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:
            ours = field.default_factory() or None  # an empty list: not given
        theirs = definition.default_value()
        if isinstance(theirs, list) and not theirs:
            theirs = None  # an empty list: nothing given, as ours
        if definition.switch_value is not None:
            theirs = bool(theirs)  # store_true's None is off
            ours = bool(ours) if ours is not None else False
        if isinstance(ours, list) and len(ours) == 1 and not isinstance(theirs, list):
            ours = ours[0]  # a nargs="+" flag whose Megatron-LM default is its one value
        if ours != theirs and str(ours) != str(theirs):  # (--moe-layer-freq: "1" and 1)
            differ[flag] = (ours, definition.default)
    assert differ == {}, differ
    assert set(DIFFERENT_DEFAULTS) <= set(definitions)


def _refused(argv):
    with pytest.raises(ConfigError) as err:
        prepare(parse(SHAPE + argv), 1)
    return str(err.value)


def test_each_kind_of_answer_on_a_command_line():
    answers = table_answers()
    # without effect: accepted, with the value Megatron-LM's parser takes
    cfg = prepare(parse(SHAPE + ["--overlap-grad-reduce", "--attention-backend", "flash"]), 1)
    assert dict(cfg.megatron.given)["--attention-backend"] == "flash"
    assert answers["--attention-backend"].kind == "accepted without effect"
    # missing: one line naming the feature and the flag to drop
    line = _refused(["--moe-latent-size", "8"])
    assert line == (
        "--moe-latent-size: expert parallelism and the rest of mixture of experts "
        "(issue 40): not available in this engine; drop --moe-latent-size"
    )
    # ... but at Megatron-LM's default it asks for nothing
    prepare(parse(SHAPE + ["--expert-model-parallel-size", "1", "--moe-router-topk", "2"]), 1)
    assert _refused(["--check-for-spiky-loss"]).startswith("--check-for-spiky-loss: rerun state")
    # not applicable: says what the flag is for
    flag = next(iter(NOT_APPLICABLE.values()))[0]
    definition = megatron_flags()[flag]
    value = [] if definition.switch_value is not None else ["x" + "1" * 3]
    if definition.choices:
        value = [next(c for c in definition.choices if c != definition.default.strip("'"))]
    line = _refused([flag, *value])
    assert line.startswith(f"{flag}: ") and "not part of pretraining GPT-style models" in line
    assert "\n" not in line


def _report(*args):
    return subprocess.run(
        [sys.executable, "-m", "engine.pretrain", "--check-megatron-args", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_migration_report_of_flags_and_of_a_script(tmp_path):
    done = _report(*SHAPE, "--attention-backend", "flash", "--moe-latent-size", "8")
    lines = done.stdout.splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--num-layers: implemented (Megatron-LM's meaning)" in lines
    assert "--attention-backend: accepted without effect: picks a kernel or fusion" in lines
    assert lines[-1] == "would train: no"
    refused = "--moe-latent-size: refused: expert parallelism"
    assert any(line.startswith(refused) for line in lines)
    assert _report(*SHAPE).stdout.splitlines()[-1] == "would train: yes"
    own = _report(*SHAPE, "--log-jsonl", "m.jsonl").stdout.splitlines()
    assert "--log-jsonl: this engine's own flag (Megatron-LM has none of this name)" in own
    bad_value = _report(*SHAPE, "--tensor-model-parallel-size", "3")
    assert bad_value.returncode == 2 and "values: " in bad_value.stdout, bad_value.stdout
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\n"
        "DISTRIBUTED_ARGS=(--nproc_per_node 8 --nnodes 1)  # torchrun's own\n"
        "MODEL_ARGS=(\n    --num-layers 2 \\\n    --use-mcore-models\n    --fp8-format hybrid\n)\n"
        'torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} --lr "$LR"\n'
    )
    done = _report(str(script))
    assert done.stdout.splitlines() == [
        "--num-layers: implemented (Megatron-LM's meaning)",
        "--use-mcore-models: accepted without effect: chooses megatron-core's models over the "
        "legacy ones, the only kind here",
        "--fp8-format: implemented (Megatron-LM's meaning)",
        "--lr: implemented (Megatron-LM's meaning)",
        "would train: yes",
    ]


def test_the_docs_page_is_the_tables():
    from engine.config.megatron.docs_page import page

    with open(f"{ROOT}/docs/megatron_flags.md", encoding="utf-8") as f:
        assert f.read() == page(), (
            "python -m engine.config.megatron.docs_page > docs/megatron_flags.md"
        )


def test_megatron_lm_older_spellings_set_the_same_options():
    unsized = list(SHAPE)
    for flag in ("--num-layers", "--seq-length"):
        del unsized[unsized.index(flag) : unsized.index(flag) + 2]

    def configs(*extra):
        return parse(unsized + list(extra))

    older = configs(
        *("--encoder-num-layers", "3", "--encoder-seq-length", "32"),
        *("--recompute-activations", "--use-rotary-position-embeddings"),
        *("--persistent-save-interval", "7", "--no-overlap-p2p-communication"),
        *("--tokenizer-hf-include-special-tokens", "--yarn-correction-range-round-to-int"),
    )
    m = older.model
    assert (m.num_layers, m.seq_length, m.recompute_granularity) == (3, 32, "selective")
    assert m.position_embedding_type == "rope" and m.yarn_correction_range_round_to_int
    assert older.checkpointing.save_interval == 7
    assert not older.tokenizer.tokenizer_hf_no_include_special_tokens
    ours = configs("--num-layers", "2", "--seq-length", "32", "--overlap-p2p-communication")
    assert ours.parallel.overlap_p2p_communication and not older.parallel.overlap_p2p_communication
    assert {"--seq-length", "--num-layers"} <= older.given  # as if given by their own names
    # a switch wins whatever the order, as Megatron-LM applies it after parsing
    for order in (
        ["--recompute-activations", "--recompute-granularity", "full"],
        ["--recompute-granularity", "full", "--recompute-activations"],
    ):
        assert (
            configs("--num-layers", "2", "--seq-length", "32", *order).model.recompute_granularity
            == "selective"
        )
    with pytest.raises(ConfigError, match="--num-layers and --encoder-num-layers both given"):
        configs("--num-layers", "2", "--encoder-num-layers", "3", "--seq-length", "32")


MEGATRON_LLAMA3_FP8 = """#!/bin/bash
# as Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh writes its flags
MODEL_ARGS=(
    "--num-layers 32"
    "--hidden-size 4096"
    "--use-mcore-models"  # a comment --not-a-flag
)
DTYPE_ARGS="--fp8-format hybrid
    --fp8-amax-history-len 1024"
python tools/preprocess_data.py --input data.json --workers 8
torchrun --nproc_per_node 8 pretrain_gpt.py ${MODEL_ARGS[@]} $DTYPE_ARGS --ckpt-format torch
"""


def test_migration_report_reads_scripts_as_the_shell_splits_them(tmp_path):
    script = tmp_path / "llama.sh"
    script.write_text(MEGATRON_LLAMA3_FP8)
    lines = _report(str(script)).stdout.splitlines()
    assert lines == [
        "--num-layers: implemented (Megatron-LM's meaning)",
        "--hidden-size: implemented (Megatron-LM's meaning)",
        "--use-mcore-models: accepted without effect: chooses megatron-core's models over the "
        "legacy ones, the only kind here",
        "--fp8-format: implemented (Megatron-LM's meaning)",
        "--fp8-amax-history-len: implemented (Megatron-LM's meaning)",
        "--ckpt-format: refused: --ckpt-format torch: only torch_dist (and fsdp_dtensor with "
        "--use-megatron-fsdp) is accepted (this engine writes its own sharded checkpoints); use "
        "torch_dist or leave it out",
        "would train: no",
    ]
    bert = tmp_path / "bert.sh"
    bert.write_text("torchrun pretrain_bert.py --num-layers 24\n")
    done = _report(str(bert))
    assert done.returncode == 2 and done.stdout.splitlines()[0].startswith(
        "pretrain_bert.py: not pretraining GPT-style models"
    )
    missing = _report(str(tmp_path / "absent.sh"))
    assert missing.returncode == 2 and missing.stdout.endswith(
        "absent.sh: no such script; give an existing script or the flags themselves\n"
    )
    # a refused flag at Megatron-LM's default asks for nothing, a switch included
    at_default = _report(*SHAPE, "--moe-router-topk", "2", "--dataloader-type", "single")
    assert at_default.returncode == 0, at_default.stdout
