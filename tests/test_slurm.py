"""docs/deploy/slurm.md's batch script: bash parses it, it asks Slurm for one task per GPU and a
SIGTERM before the time limit, drains within Slurm's default KillWait, and keeps the Redis URL out
of argv (it comes from an env file read inside the job)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "deploy" / "slurm.md"
KILL_WAIT_DEFAULT_S = 30  # slurm.conf's KillWait unless the cluster sets it


def batch_script() -> str:
    """The page's first bash block (the one under "The batch script")."""
    section = PAGE.read_text().split("## The batch script", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "no bash block under 'The batch script'"
    return match.group(1)


def bash_n(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / name
    path.write_text(text)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)


def parses(tmp_path: Path, script: str) -> bool:
    """bash parses the script, and the program each srun task runs (its ``bash -c '...'``)."""
    task = re.search(r"bash -c '([^']*)'\s*$", script)
    assert task, "no srun bash -c '...' at the end of the script"
    return all(bash_n(tmp_path, name, text).returncode == 0
               for name, text in (("job.sbatch", script), ("task.sh", task.group(1))))


def test_the_batch_script_and_its_task_program_parse(tmp_path: Path) -> None:
    script = batch_script()
    assert parses(tmp_path, script)
    assert not parses(tmp_path, script.replace("  done'", "'"))  # the task's loop left open
    assert not parses(tmp_path, script.replace("set +a", "set +a\nif true; then"))  # the job's own


def test_one_worker_per_gpu_drained_by_sigterm_with_the_url_from_the_environment() -> None:
    script = batch_script()
    directives = dict(re.findall(r"^#SBATCH (--[a-z-]+)=(\S+)", script, re.M))
    assert directives["--gpus-per-task"] == "1"
    assert directives["--signal"].startswith("TERM@")
    drain = re.search(r'ROLLOUT_FLEET_DRAIN_TIMEOUT_S="\$\{ROLLOUT_FLEET_DRAIN_TIMEOUT_S:-(\d+)\}"', script)
    assert drain and int(drain.group(1)) < KILL_WAIT_DEFAULT_S
    assert re.search(r"^srun .*bash -c", script, re.M)
    assert "until rollout-fleet worker; do" in script  # no flag on the worker's command line
    assert "redis://" not in script and "--redis-url" not in script
    assert ': "${ROLLOUT_FLEET_REDIS_URL:?' in script  # refuses to start without it
