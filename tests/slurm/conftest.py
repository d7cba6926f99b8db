"""The Slurm tier: a real one-node Slurm (Debian's slurmctld and slurmd, started here on free ports
with a private slurm.conf) that runs docs/deploy/slurm.md's batch script unchanged.

The node offers two GPUs to the scheduler (``Gres=gpu:2``), backed by stand-in device nodes (the
character device of /dev/null under the names nvidia0 and nvidia1): ``--gpus-per-task`` placement
and ``CUDA_VISIBLE_DEVICES`` are Slurm's own, while the workers' engine runs on the CPU. Tests here
carry the ``slurm`` mark and are collected only when ``-m`` names it (``make test-slurm``, which
installs the packages when missing), so the fast and slow tiers never start Slurm."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.redis.embedded import free_port

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo", "squeue")
GPUS = 2
START_TIMEOUT_S = 60.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Items marked ``slurm`` run only when ``-m`` names the mark."""
    if "slurm" in (config.getoption("markexpr") or ""):
        return
    left_out = [item for item in items if item.get_closest_marker("slurm") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@dataclass
class Slurm:
    """A running one-node cluster: its config, and the commands that talk to it."""

    root: Path
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 30.0) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-o", "%t").strip()

    def log_tail(self) -> str:
        return "\n".join(f"== {name}\n" + "\n".join((self.root / name).read_text().splitlines()[-20:])
                         for name in ("slurmctld.log", "slurmd.log") if (self.root / name).exists())


def _config(root: Path, host: str) -> str:
    ctld_port, slurmd_port = free_port(), free_port()
    return "\n".join([
        "ClusterName=rolloutfleet",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/none",  # one host, private ports: no munge daemon to run
        "CredType=cred/none",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "KillWait=30",  # Slurm's default: SIGKILL this long after scancel's SIGTERM
        "ReturnToService=2",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} Gres=gpu:{GPUS} State=UNKNOWN",
        f"PartitionName=fleet Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


def _stand_in_gpus(root: Path, host: str) -> None:
    for index in range(GPUS):
        path = root / f"nvidia{index}"
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a char device, as /dev/null
        except PermissionError:  # no CAP_MKNOD: slurmd logs that a plain file is no device, and counts it
            path.touch()
    (root / "gres.conf").write_text(f"NodeName={host} Name=gpu File={root}/nvidia[0-{GPUS - 1}]\n")


def _wait_idle(slurm: Slurm, daemons: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if slurm.node_state() == "idle":
                return
        if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
            raise RuntimeError(f"the Slurm node did not come up within {START_TIMEOUT_S:g}s\n{slurm.log_tail()}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    missing = [name for name in SLURM_BINARIES if shutil.which(name) is None]
    if missing:
        pytest.fail(f"no {', '.join(missing)}: `make test-slurm` installs Debian's slurmd, slurmctld and slurm-client")
    root = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    host = socket.gethostname().split(".")[0]
    (root / "slurm.conf").write_text(_config(root, host))
    _stand_in_gpus(root, host)
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    slurm = Slurm(root, env)
    daemons = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D"])]
    try:
        _wait_idle(slurm, daemons)
        yield slurm
    finally:
        with contextlib.suppress(Exception):
            slurm.run("scancel", "--full", "--partition=fleet")
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
