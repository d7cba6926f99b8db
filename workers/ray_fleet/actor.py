"""One fleet worker under one Ray actor.

The actor owns a ``rollout-fleet worker`` child process: its own process, as every worker of the
fleet runs (the engine's CUDA context, its signals and its drain stay the worker's), started with
``python -m cli.main worker`` and no option on its command line: the Redis URL, the engine and its
options reach it through ``ROLLOUT_FLEET_*`` variables (``ps`` shows argv to every user of a node).
The child inherits the actor's environment, so the GPUs Ray reserved for the actor
(``CUDA_VISIBLE_DEVICES``) are the worker's.

Healing: a keeper thread waits on the child. A child that exits while nobody asked it to drain
takes the actor down with it (``os._exit``), so Ray restarts the actor (``max_restarts``) and the
restarted actor starts a fresh worker; meanwhile the fleet's lease moves the dead worker's
sessions. The other way round, the child gets SIGKILL from the kernel when the keeper thread's
process dies (``PR_SET_PDEATHSIG``), so a killed actor never leaves a worker running on a GPU
that Ray hands to the actor's next incarnation.

Ray is not imported here at module level: the module is importable without Ray, and the
controller wraps :class:`WorkerActor` with ``ray.remote`` when it places one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from workers.ray_fleet.spec import node_advertise

log = logging.getLogger(__name__)

WORKER_ARGV = ("-m", "cli.main", "worker")  # every option comes from the environment
WORKER_ID_VAR = "ROLLOUT_FLEET_WORKER_ID"
DRAIN_MARGIN_S = 30.0  # beyond the worker's own drain bound, before the child is killed
MIN_LIFE_S = 10.0  # a worker that exits sooner holds its actor back until then before it exits too
START_TIMEOUT_S = 30.0  # the keeper thread has the child started within this (a fork and an exec)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child before exec
    """SIGKILL this process when the thread that started it dies (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class WorkerActor:
    """One worker process under one Ray actor: started at construction, drained on request."""

    def __init__(self, index: int, worker_env: Mapping[str, str], id_stem: str, drain_timeout_s: float) -> None:
        self.index = index
        self._env = dict(worker_env)
        self._id_stem = id_stem
        self._drain_timeout_s = drain_timeout_s
        self._draining = threading.Event()
        self._started = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self.worker_id = ""
        self.started_at = time.time()
        keeper = threading.Thread(target=self._keep, name="rollout-fleet-worker-keeper", daemon=True)
        keeper.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"worker {index}: its process did not start within {START_TIMEOUT_S:g} s")

    def _spawn(self) -> subprocess.Popen[bytes]:
        import ray

        self.worker_id = f"{self._id_stem}-{self.index}-{uuid.uuid4().hex[:6]}"
        env = {**os.environ, **self._env, WORKER_ID_VAR: self.worker_id}
        env.update(node_advertise(env, ray.util.get_node_ip_address()))  # large results in one hop, if served
        return subprocess.Popen([sys.executable, *WORKER_ARGV], env=env, preexec_fn=_die_with_parent)

    def _keep(self) -> None:
        """Start the worker and wait on it; an exit nobody asked for ends this actor's process."""
        self._proc = self._spawn()
        self._started.set()
        code = self._proc.wait()
        if self._draining.is_set():
            return
        log.error("worker %s exited by itself with %s: this actor exits so that Ray restarts it",
                  self.worker_id, code)
        # A worker that cannot start (a wrong engine option) would restart as fast as Ray can: at
        # most one start per MIN_LIFE_S.
        time.sleep(max(0.0, MIN_LIFE_S - (time.time() - self.started_at)))
        os._exit(1)

    def drain(self) -> int | None:
        """SIGTERM the worker (it hands its sessions over to live workers, then exits) and wait for
        it, bounded by its drain timeout plus a margin; past that it is killed. Its exit status, or
        None when it had to be killed."""
        self._draining.set()
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(self._drain_timeout_s + DRAIN_MARGIN_S)
        except subprocess.TimeoutExpired:
            log.warning("worker %s still running %g s after SIGTERM: killed", self.worker_id,
                        self._drain_timeout_s + DRAIN_MARGIN_S)
            proc.kill()
            proc.wait(DRAIN_MARGIN_S)
            return None

    def info(self) -> dict[str, Any]:
        """What ``status`` shows of this actor: plain values only."""
        import ray

        context = ray.get_runtime_context()
        proc = self._proc
        return {
            "index": self.index, "worker_id": self.worker_id, "node_id": context.get_node_id(),
            "pid": proc.pid if proc else None, "running": proc is not None and proc.poll() is None,
            "draining": self._draining.is_set(), "restarted": bool(context.was_current_actor_reconstructed),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "started_at": self.started_at,
        }
