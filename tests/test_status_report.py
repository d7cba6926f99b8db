"""The status table says what ``status --json`` says: a worker is ``live`` or not."""

from __future__ import annotations

from broker.ops.status import CellReport, WorkerInfo, format_status


def test_the_table_names_liveness_as_the_json_does() -> None:
    beating = WorkerInfo("w-beating", 50, {"state": "running"}, 0, 0)
    silent = WorkerInfo("w-silent", 5000, {"state": "running"}, 0, 0)
    report = CellReport(workers=[beating, silent])
    header, *rows = format_status(report, lease_ms=1000).splitlines()
    assert header.split()[:3] == ["worker", "state", "live"] and "alive" not in header
    assert [w["live"] for w in report.as_json(1000)["workers"]] == [True, False]
    assert rows[0].split()[:3] == ["w-beating", "running", "yes"]
    assert rows[1].split()[:3] == ["w-silent", "running", "NO"]
