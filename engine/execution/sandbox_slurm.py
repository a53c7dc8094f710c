"""A real Slurm on this machine for the tests and tools/bench_curate.py: a controller and one
node (Debian's slurm-wlm, which .ci/run installs), started with a configuration and a munge
daemon of their own in a short temporary folder and stopped afterwards, so that clusters
running side by side never share (or stop) each other's daemons. Needs root (slurmd runs jobs
as their user) and munge; the tests skip where Slurm is not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

CONF = """ClusterName=tripodtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
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
    """`with SlurmCluster() as env:` runs Slurm; `env` is the environment its commands (sbatch,
    squeue, scontrol) need. Its folder is a short one under /tmp (slurmd's and munge's sockets
    live there, at most 108 bytes a path), kept when the cluster failed to come up."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="slurm", dir="/tmp")
        self.env = dict(os.environ, SLURM_CONF=os.path.join(self.root, "slurm.conf"))

    def _start_munge(self) -> None:
        key = os.path.join(self.root, "munge.key")
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        paths = {"socket": "munge.socket", "key-file": "munge.key", "pid-file": "munged.pid"}
        paths |= {"seed-file": "munged.seed", "log-file": "munged.log"}
        options = [f"--{name}={os.path.join(self.root, file)}" for name, file in paths.items()]
        subprocess.run(["munged", "--force", *options], check=True, capture_output=True)

    def __enter__(self) -> dict:
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        ports = {"ctld_port": _free_port(), "slurmd_port": _free_port()}
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(CONF.format(root=self.root, cpus=os.cpu_count() or 1, **ports))
        try:
            self._start_munge()
            subprocess.run(["slurmctld"], env=self.env, check=True)
            subprocess.run(["slurmd"], env=self.env, check=True)
            deadline, state = time.monotonic() + 60, ""
            while time.monotonic() < deadline:
                state = self.run("sinfo", "-h", "-o", "%T").stdout.strip()
                if state == "idle":
                    return self.env
                time.sleep(0.5)
            raise RuntimeError(f"the Slurm node did not come up (state {state!r}): {self.root}")
        except BaseException as error:  # what did start stops
            self.__exit__(type(error))
            raise

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True)

    def __exit__(self, error_type, *exc) -> None:
        self.run("scancel", "-u", "root")
        deadline = time.monotonic() + 15  # scancel only asks: let the jobs' steps end first
        while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = []
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                with open(os.path.join(self.root, pid_file)) as f:
                    pids.append(int(f.read().strip()))
                os.kill(pids[-1], 15)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if error_type is None:  # kept for a look when something failed
            shutil.rmtree(self.root, ignore_errors=True)
