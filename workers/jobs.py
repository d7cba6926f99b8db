"""The worker's name for inbox entries: a Job (or a BadJob when it does not parse). The layout
itself, and its parsing, belong to :mod:`broker.redis.inbox`."""

from __future__ import annotations

from broker.redis.inbox import KINDS
from broker.redis.inbox import BadEntry as BadJob
from broker.redis.inbox import InboxEntry as Job
from broker.redis.inbox import parse_inbox_entry as parse_job

__all__ = ["KINDS", "BadJob", "Job", "parse_job"]
