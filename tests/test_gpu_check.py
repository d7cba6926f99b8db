"""scripts/gpu_check.sh and bench/gpu_check.py: on a machine without a GPU the script says so at
once and exits 2; the checks it runs hold on the CPU and catch a differing result."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.common import Latencies
from workers.engines.reference import LM_MODEL, WORLD_MODEL

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SHAPE = (1, 4, 2, 8, 10)


def bare_path(tmp_path: Path, tools: tuple[str, ...]) -> str:
    """A PATH holding only ``tools`` (links to the real ones): no nvidia-smi, whatever the host has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def run_script(path: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT)], env={"HOME": os.environ.get("HOME", "/root"), "PATH": path, **env},
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def test_script_without_a_gpu_fails_fast_and_says_why(tmp_path: Path) -> None:
    done, took = run_script(bare_path(tmp_path, ("bash", "dirname", "timeout")), PYTHON=sys.executable)
    assert done.returncode == 2, done
    assert "gpu_check: NO GPU: nvidia-smi is not installed" in done.stderr
    assert took < 30, took
    assert done.stdout == ""  # nothing was started


def test_script_with_a_gpu_but_no_engines_fails_fast_and_says_why(tmp_path: Path) -> None:
    """nvidia-smi answers (a script standing in for the driver's tool), the python is missing."""
    path = bare_path(tmp_path, ("bash", "dirname", "timeout"))
    smi = Path(path) / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    smi.chmod(0o755)
    done, took = run_script(path, PYTHON=str(tmp_path / "no-such-python"))
    assert done.returncode == 2, done
    assert "gpu_check: NO ENGINES" in done.stderr and took < 30


def test_cuda_device_missing_is_a_clear_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert gpu_check.main(["--device", "cuda"]) == gpu_check.EXIT_NO_DEVICE
    assert "NO DEVICE: torch.cuda.is_available() is False" in capsys.readouterr().err


@pytest.mark.parametrize("model", [WORLD_MODEL, LM_MODEL])
def test_batch_invariance_holds_on_cpu(model: str) -> None:
    alone = gpu_check.direct_alone("cpu", SHAPE, model, sessions=2, steps=2)
    together = gpu_check.direct_together("cpu", SHAPE, model, sessions=2, steps=2, lat=Latencies())
    gpu_check.compare(model, alone, together)
    assert len({step for session in alone for step in session}) == 4  # sessions and steps all differ


def test_compare_catches_one_flipped_bit() -> None:
    alone = gpu_check.direct_alone("cpu", SHAPE, WORLD_MODEL, sessions=2, steps=2)
    flipped = bytearray(alone[1][1])
    flipped[-1] ^= 1
    with pytest.raises(gpu_check.CheckFailed, match="session 1 step 1 differs"):
        gpu_check.compare("world", alone, [alone[0], [alone[1][0], bytes(flipped)]])


@pytest.mark.slow
def test_the_whole_check_passes_on_cpu() -> None:
    """The module as the script runs it, with a real fleet worker process, on the CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--sessions", "2",
                           "--steps", "2", "--latent-shape", ",".join(map(str, SHAPE)), "--budget-s", "240"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("batch invariance reference-world: ok", "batch invariance reference-lm: ok",
                 "fleet equals direct reference-world: ok", "fleet equals direct reference-lm: ok",
                 "all checks passed"):
        assert line in done.stdout, done.stdout
    assert "engine step reference-world: batch of 1 p50=" in done.stdout
