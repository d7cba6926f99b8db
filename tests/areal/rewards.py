"""Reward functions for AReaL's workflows, at module level: AReaL's AsyncRewardWrapper runs them in
a process pool, which imports them by name."""

from __future__ import annotations

from typing import Any


def completion_length(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                      **data: Any) -> float:
    """A reward that depends on what was generated: its token count."""
    return float(len(completion_ids))


def says_four(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """1 when the answer is 4, else 0 (MultiTurnWorkflow asks again while the reward is 0)."""
    return 1.0 if "It is 4" in completion else 0.0
