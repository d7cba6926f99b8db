"""The markdown of one run for docs/benchmarks.md: how it was made, on what, the targets, the table.

``python -m bench.run_all ... --markdown docs/benchmarks.md`` writes it between the two marker
lines below when the file has them (the rest of the page stays as written: history, the sections
that explain the numbers), and writes the file whole otherwise. So the page's current table is
always one command's output, never edited by hand.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Row, format_markdown

BEGIN = "<!-- bench:current:begin (written by bench.run_all --markdown; do not edit by hand) -->"
END = "<!-- bench:current:end -->"


def _number(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}" if abs(value) >= 100 else f"{value:.2f}"


def targets_table(rows: Sequence[Row]) -> str:
    """One line per target: what was measured, the goal, met or missed and by how much."""
    out = ["| target | measured | goal | verdict |", "|---|---|---|---|"]
    for row in rows:
        if row.bench != "targets":
            continue
        goal = row.note.removeprefix("target ").split(";", 1)[0]
        factor = row.values.get("factor", float("nan"))
        verdict = f"met ({_number(factor)}x to spare)" if row.system == "met" else f"**missed by {_number(factor)}x**"
        out.append(f"| {row.case} | {_number(row.values['measured'])} | {goal} | {verdict} |")
    return "\n".join(out)


def machine_lines(report: Mapping[str, Any]) -> list[str]:
    m = report["machine"]
    load = report.get("loadavg", {})
    walls = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in report["wall_s"].items())
    return [
        f"- command: `{report['command']}`",
        f"- when: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(report['started']))}; "
        f"wall time {report['elapsed_s']:.0f} s ({walls})",
        f"- machine: {m['nproc']} CPUs ({m['cpu'] or 'model unknown'}), {m['platform']}, Python {m['python']}, "
        f"{m['redis'] or 'redis-server version unknown'}",
        f"- load average (1 min) at the start / end: {_load(load.get('start'))} / {_load(load.get('end'))}"
        " (everything shares these CPUs: trainers, workers, Redis and the anchors)",
    ]


def _load(value: Any) -> str:
    return "unknown" if value is None else f"{float(value):.2f}"


def markdown(report: Mapping[str, Any], rows: Sequence[Row]) -> str:
    """The current-run section: how, on what, the targets, then every measured row."""
    failed = report.get("failed") or []
    parts = [BEGIN, "", *machine_lines(report)]
    if failed:
        parts.append(f"- **failed**: {', '.join(failed)} (their rows say why)")
    parts += ["", "### Targets (ratios inside this run)", "", targets_table(rows), "",
              "### Every measured row", "", format_markdown([r for r in rows if r.bench != "targets"]), "", END]
    return "\n".join(parts)


def write(path: Path, text: str) -> None:
    """Replace the marked section of ``path`` with ``text`` (itself marked); the whole file when
    ``path`` does not exist or has no markers."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    head, begin, rest = old.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if begin and end:
        path.write_text(head + text + tail, encoding="utf-8")
    else:
        path.write_text(text + "\n", encoding="utf-8")


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "bench.run_all", *argv])
