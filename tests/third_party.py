"""The framework tiers (verl, RLinf, AReaL) run third-party code that warns freely (the frameworks,
ray, transformers, hydra, omegaconf): their tests ignore those warning categories, while the
project's own "warnings are errors" stays for everything else."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

THIRD_PARTY_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning",
                        "ResourceWarning")


def tolerate_warnings(items: list[pytest.Item], marker: str, extra: Sequence[str] = ()) -> None:
    """Ignore the third-party warning categories (and ``extra``) in the tests marked ``marker``."""
    for item in items:
        if item.get_closest_marker(marker) is not None:
            for category in (*THIRD_PARTY_WARNINGS, *extra):
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
