"""`rollout-fleet bench` interrupted (Ctrl-C, or SIGTERM from a job runner) stops every process it
started: the benchmark running is cancelled, its workers and its Redis stopped, the results so far
written; the exit status says which signal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_FLEET_")}


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0]


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[0]
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


@pytest.mark.slow  # a bench start, its first workers, then their stop (seconds)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_bench_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    results = tmp_path / "latest.json"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "bench", "--size", "smoke", "--only", "round_trip",
                             "--no-progress", "--results", str(results), "--plot", str(tmp_path / "plot.png")],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[int, str] = {}  # every process started under the CLI, with its command line
    try:
        deadline = time.monotonic() + 120  # bounded: imports, a Redis and the first workers
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update({pid: _command(pid) for pid in _descendants(proc.pid) if pid not in seen})
            if any(" worker " in command for command in seen.values()):
                break
            time.sleep(0.2)
        assert any(" worker " in command for command in seen.values()), f"no worker started: {seen}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        left = {pid: command for pid, command in seen.items() if _running(pid) and _command(pid) == command}
        assert left == {}, f"still running after the bench exited: {left}"
        assert proc.returncode == 128 + sig, err
        assert f"bench: interrupted by {sig.name}" in err
        assert json.loads(results.read_text(encoding="utf-8"))["interrupted"] == sig.name
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, command in seen.items():  # today's leftovers, so that a failure leaks nothing
            if _running(pid) and _command(pid) == command:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
