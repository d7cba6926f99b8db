"""Logging as the CLI configures it (the only place that does): text or one JSON object a line.

JSON lines are for log shippers (Loki, Elasticsearch, CloudWatch): one object per record with
``ts``, ``level``, ``logger``, ``message`` and, when an exception is logged, ``exc_info``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# arq logs every job it runs at INFO ("0.00s → cron:reap_job()"): the supervisor's cron passes
# would be two lines a second. Those routine lines show at DEBUG only; arq's warnings always do.
QUIET_LOGGERS = ("arq",)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = record.stack_info
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root handler on stderr at ``level`` (one of LEVELS) in ``fmt`` (one of FORMATS)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    quiet = logging.DEBUG if level == "DEBUG" else logging.WARNING
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
