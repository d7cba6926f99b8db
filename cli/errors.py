"""The mistakes an operator is expected to make, answered with one line on stderr and exit 2.

A traceback is for bugs: Redis not reachable, a refused password or ACL, and a missing optional
dependency are conditions of the deployment, so the CLI names them and the fix instead.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import RedisError

USAGE_ERROR = 2
# The module a verb failed to import -> the extra of pyproject.toml that installs it.
EXTRA_OF = {"fastapi": "gateway", "uvicorn": "gateway", "httpx": "http", "torch": "reference", "PIL": "render",
            "streaq": "bench", "matplotlib": "bench", "pyinstrument": "bench", "ray": "ray"}
_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")

T = TypeVar("T")


class UsageError(Exception):
    """A mistake in the invocation found after parsing (e.g. an option that needs another)."""


def redact(url: str) -> str:
    """``url`` without its password (error messages and --help may be read by others)."""
    return _PASSWORD.sub(r"\1***@", url)


def missing_extra(exc: ModuleNotFoundError, verb: str) -> str | None:
    """The one-line fix for a missing optional dependency, or None when it is not one of ours."""
    top = (exc.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    extra = "gateway" if verb == "gateway" else EXTRA_OF[top]
    return f"the {verb} verb needs {top}: install rollout-fleet[{extra}]"


def one_line(verb: str, redis_url: str | None, run: Callable[[], int]) -> int:
    """``run()``, with the expected mistakes turned into one line on stderr and exit 2."""
    try:
        return run()
    except UsageError as exc:
        message = str(exc)
    except ModuleNotFoundError as exc:
        fix = missing_extra(exc, verb)
        if fix is None:
            raise
        message = fix
    except (RedisError, ConnectionError) as exc:
        where = f" at {redact(redis_url)}" if redis_url else ""
        message = f"Redis{where} did not answer as expected: {redact(str(exc)) or type(exc).__name__}"
    print(f"rollout-fleet {verb}: error: {message}", file=sys.stderr)
    return USAGE_ERROR
