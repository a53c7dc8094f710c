"""What would break on the first GPU, checked on the CPU: each rank's device, GPUs kept away
from the CPU test ranks, the set-up leaving a machine's own torch in place, and the launch
script counting the GPUs torch may use."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

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
