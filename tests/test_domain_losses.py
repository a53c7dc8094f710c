"""The loss of each dataset of a blend (`--data-path 0.6 web:A 0.4 code:B`), computed from the
same forward pass as the overall loss: by definition on one micro-batch, and through the engine
under TP 2 x PP 2 x DP 2 against one process, where the parts must add up to the overall loss."""

from __future__ import annotations

import math
import subprocess
import sys

import torch

from engine.train.loss import domain_losses, make_loss_func
from tests.test_training import ROOT, base_args, pretrain, records


def test_each_dataset_loss_is_the_mean_over_its_tokens():
    """[b, s] per-token losses of samples from datasets 0, 1, 0, 2 (none from 3): each loss is
    the (masked) mean over that dataset's tokens, the shares are their token fractions, and
    sum(share * loss) is the micro-batch's mean; with no domains the value stays a scalar."""
    generator = torch.Generator().manual_seed(0)
    per_token = torch.rand(4, 6, generator=generator)
    domain = torch.tensor([0, 1, 0, 2])
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    names = ("web", "code", "books", "empty")
    for loss_mask in (None, mask):
        batch = {"domain": domain} | ({} if loss_mask is None else {"loss_mask": loss_mask})
        _, reported = make_loss_func(1, num_domains=4)(per_token, batch)
        assert reported.shape == (9,)
        found = domain_losses(reported[1:].tolist(), names)
        weights = torch.ones_like(per_token) if loss_mask is None else loss_mask
        assert sorted(found) == ["books", "code", "web"]  # no tokens from "empty"
        for d, name in enumerate(names[:3]):
            rows = domain == d
            expected = (per_token[rows] * weights[rows]).sum() / weights[rows].sum()
            assert math.isclose(found[name][0], expected.item(), rel_tol=1e-6)
            share = (weights[rows].sum() / weights.sum()).item()
            assert math.isclose(found[name][1], share, rel_tol=1e-6)
        total = sum(loss * share for loss, share in found.values())
        assert math.isclose(total, reported[0].item(), rel_tol=1e-6)
    _, plain = make_loss_func(1)(per_token, {"domain": domain})
    assert plain.dim() == 0


def test_dataset_losses_add_up_and_match_one_process(dataset_prefix, tokenizer_model, tmp_path):
    blend = ["0.6", f"web:{dataset_prefix}", "0.4", f"code:{dataset_prefix}"]
    found = {}
    for world, layout in ((1, {}), (8, {"--tensor-model-parallel-size": "2"})):
        log = str(tmp_path / f"log{world}.jsonl")
        flags = {"--pipeline-model-parallel-size": "2"} if world > 1 else {}
        args = base_args(
            blend,
            tokenizer_model,
            **layout,
            **flags,
            **{"--train-iters": "3", "--eval-interval": "2", "--eval-iters": "2"},
            **{"--log-jsonl": log, "--hidden-dropout": "0", "--attention-dropout": "0"},
            **{"--log-grad-norms-interval": "1"},
        )
        assert pretrain(world, args) == [0] * world
        found[world] = records(log)
    for record in found[8]:
        shares = {k: v for k, v in record.items() if k.startswith("lm_loss_share/")}
        assert sorted(shares) == ["lm_loss_share/code", "lm_loss_share/web"], record
        assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
        total = sum(record[f"lm_loss/{k.split('/')[1]}"] * v for k, v in shares.items())
        assert math.isclose(total, record["lm_loss"], rel_tol=1e-6)
    assert len(found[1]) == len(found[8]) >= 5  # 3 training records, 2 evaluations
    for one, eight in zip(found[1], found[8], strict=True):
        assert one.get("split") == eight.get("split")
        for name in ("web", "code"):
            assert math.isclose(one[f"lm_loss/{name}"], eight[f"lm_loss/{name}"], rel_tol=1e-5)
            share = f"lm_loss_share/{name}"
            assert math.isclose(one[share], eight[share], rel_tol=1e-9)

    # the dashboard overlays both runs: losses per dataset, the per-layer heat map, ...
    png = tmp_path / "dashboard.png"
    result = subprocess.run(
        [sys.executable, "tools/plot_metrics.py", "--log-jsonl", str(tmp_path / "log1.jsonl"),
         str(tmp_path / "log8.jsonl"), "--output", str(png)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
