"""A real Slurm for the tests: a controller and one node on this machine (Debian's slurm-wlm,
which .ci/run installs), started with a configuration of its own in a temporary folder and
stopped afterwards. Needs root (slurmd runs jobs as their user) and munge; tests skip where
Slurm is not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

CONF = """ClusterName=tripodtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
MpiDefault=none
NodeName=localhost CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


MUNGE_PID_FILE = "/run/munge/munged.pid"


def slurm_available() -> str | None:
    """Why Slurm cannot run here, or None."""
    for program in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(program) is None:
            return f"{program} is not installed (.ci/run installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "slurmd needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """`with SlurmCluster(folder) as env:` runs Slurm; `env` is the environment its commands
    (sbatch, squeue, scontrol) need."""

    def __init__(self, root: str):
        self.root = root
        self.env = dict(os.environ, SLURM_CONF=os.path.join(root, "slurm.conf"))
        self.started_munge = False

    def __enter__(self) -> dict:
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        ports = {"ctld_port": _free_port(), "slurmd_port": _free_port()}
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(CONF.format(root=self.root, cpus=os.cpu_count() or 1, **ports))
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            os.makedirs("/run/munge", exist_ok=True)
            subprocess.run(["munged", "--force"], check=True, capture_output=True)
            self.started_munge = True
        subprocess.run(["slurmctld"], env=self.env, check=True)
        subprocess.run(["slurmd"], env=self.env, check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T").stdout.strip()
            if state == "idle":
                return self.env
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node did not come up (state {state!r}); see {self.root}")

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True)

    def __exit__(self, *exc) -> None:
        self.run("scancel", "-u", "root")
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            try:
                with open(os.path.join(self.root, pid_file)) as f:
                    os.kill(int(f.read().strip()), 15)
            except (OSError, ValueError):
                pass
        if self.started_munge:
            try:
                with open(MUNGE_PID_FILE) as f:
                    os.kill(int(f.read().strip()), 15)
            except (OSError, ValueError):
                pass
