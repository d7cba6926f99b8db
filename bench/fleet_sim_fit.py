"""Constants from fleet_sim reports, and the capacities they give (docs/sizing.md).

    python -m bench.fleet_sim_fit w60.json w300.json w1000.json [--gpus 10000] [--rates 1,5,20]

A master's main thread is busy ``f + b*w + c*r`` seconds per second, with ``w`` workers and ``r``
steps/s on its cells: ``f`` its floor (cron, cluster bus), ``b`` what one idle worker costs
(heartbeats, blocked reads that time out, reaping, sweeps), ``c`` what one step costs. Every
(window, master) pair of the reports is one equation; least squares gives ``f``, ``b`` and ``c``
for token steps and for latent steps (the idle windows are in both fits). A master then sustains
``(u - f - b*w) / c`` steps/s at utilisation ``u``; a fleet of ``W`` workers at ``R`` steps/s needs
``N >= (b*W + c*R) / (u - f)`` masters, and, for latents, ``R * bytes_per_step / N`` within each
master's network share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("token", "latent")


@dataclass(frozen=True)
class Fit:
    floor_s: float  # main-thread seconds per second of a master with no worker and no step
    per_worker_s: float  # ... added by each idle worker
    per_step_s: float  # ... by each step
    rms_s: float  # the fit's residual, same unit
    points: int
    bytes_per_step: float  # into and out of Redis, mean over the reports

    def master_rate(self, utilisation: float, workers_per_master: float) -> float:
        return max(0.0, (utilisation - self.floor_s - self.per_worker_s * workers_per_master) / self.per_step_s)

    def masters_for(self, steps_s: float, workers: int, utilisation: float) -> int:
        return max(1, math.ceil((self.per_worker_s * workers + self.per_step_s * steps_s)
                                / (utilisation - self.floor_s)))


def _workers_per_master(report: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for cell in report["cells"].values():
        out[cell["master"]] = out.get(cell["master"], 0) + int(cell["workers"])
    return out


def fit(reports: Sequence[dict[str, Any]], kind: str) -> Fit:
    rows: list[tuple[float, float, float]] = []
    busy: list[float] = []
    sent: list[float] = []
    for report in reports:
        workers = _workers_per_master(report)
        for master, used in report["idle"]["per_master_s"].items():
            rows.append((1.0, workers[master], 0.0))
            busy.append(used["main_cpu_us"] / 1e6)
        if kind not in report:
            continue
        window = report[kind]
        sent.append(window["per_step"]["net_in_bytes"] + window["per_step"]["net_out_bytes"])
        for master, m in window["masters"].items():
            rows.append((1.0, workers[master], m["steps"] / window["seconds"]))
            busy.append(m["per_step"]["main_cpu_us"] * m["steps"] / 1e6 / window["seconds"])
    if not sent:
        raise ValueError(f"no report has a {kind} window")
    a, y = np.asarray(rows), np.asarray(busy)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    rms = float(np.sqrt(np.mean((y - a @ coef) ** 2)))
    return Fit(float(coef[0]), float(coef[1]), float(coef[2]), rms, len(y), float(np.mean(sent)))


def constants_table(fits: dict[str, Fit]) -> list[str]:
    out = ["| kind | floor (µs/s per master) | per idle worker (µs/s) | per step (µs) | fit rms (µs/s) | "
           "points | bytes in+out per step |", "|---|---|---|---|---|---|---|"]
    for kind, f in fits.items():
        out.append(f"| {kind} | {f.floor_s * 1e6:,.0f} | {f.per_worker_s * 1e6:.1f} | {f.per_step_s * 1e6:,.0f} | "
                   f"{f.rms_s * 1e6:,.0f} | {f.points} | {f.bytes_per_step:,.0f} |")
    return out


def fleet_table(fits: dict[str, Fit], gpus: int, rates: dict[str, list[float]], utilisation: float,
                nic_bytes_s: float) -> list[str]:
    out = [f"| kind | steps/s per GPU | fleet steps/s | masters (Redis CPU at {utilisation:.0%}) | "
           f"masters (network at {utilisation:.0%} of {nic_bytes_s * 8 / 1e9:.0f} Gb/s) | masters needed |",
           "|---|---|---|---|---|---|"]
    for kind, f in fits.items():
        for rate in rates[kind]:
            total = rate * gpus
            cpu = f.masters_for(total, gpus, utilisation)
            net = max(1, math.ceil(total * f.bytes_per_step / (utilisation * nic_bytes_s)))
            out.append(f"| {kind} | {rate:g} | {total:,.0f} | {cpu} | {net} | {max(cpu, net)} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_sim_fit", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="JSON reports of bench.fleet_sim --json")
    p.add_argument("--gpus", type=int, default=10_000)
    p.add_argument("--token-rates", default="1,5,20,50", help="token steps/s per GPU, comma-separated")
    p.add_argument("--latent-rates", default="0.5,1,2,5", help="latent steps/s per GPU, comma-separated")
    p.add_argument("--utilisation", type=float, default=0.8, help="of one core, a master's main thread")
    p.add_argument("--nic-gbit", type=float, default=10.0, help="a master's network, Gb/s")
    p.add_argument("--per-worker-us", type=float, default=None,
                   help="an idle worker's cost (µs/s) in place of the fitted one, e.g. from an idle-only run "
                        "at other heartbeat settings")
    args = p.parse_args(argv)
    try:
        reports = [json.loads(path.read_text(encoding="utf-8")) for path in args.reports]
        rates = {"token": [float(x) for x in args.token_rates.split(",")],
                 "latent": [float(x) for x in args.latent_rates.split(",")]}
        fits = {kind: fit(reports, kind) for kind in KINDS if any(kind in r for r in reports)}
        if args.per_worker_us is not None:
            fits = {kind: dataclasses.replace(f, per_worker_s=args.per_worker_us / 1e6) for kind, f in fits.items()}
    except (OSError, ValueError, KeyError) as exc:
        print(f"fleet_sim_fit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(constants_table(fits)))
    print()
    print("\n".join(fleet_table(fits, args.gpus, rates, args.utilisation, args.nic_gbit * 1e9 / 8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
