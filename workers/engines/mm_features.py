"""Multimodal features of token sessions, shared by the vLLM engines.

A step's ``multimodal`` is the ``features`` object ``/v1/chat/completions/render`` returned for that
step's ``token_ids`` (``mm_hashes``, ``mm_placeholders``, ``kwargs_data``; placeholder offsets
relative to those ids). An engine keeps each session's features shifted to session offsets and
sends the features of every turn so far with each step, so the engine sees one consistent prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas.errors import InvalidRequestError
from schemas.messages import TokenStep
from workers.engines.base import EngineRequest


def shift_features(features: Mapping[str, Any], offset: int) -> dict[str, Any]:
    """``features`` (of ``/render``) with every placeholder offset moved by ``offset`` tokens."""
    out = dict(features)
    out["mm_placeholders"] = {
        modality: [{**dict(p), "offset": int(p["offset"]) + offset} for p in ranges]
        for modality, ranges in (features.get("mm_placeholders") or {}).items()
    }
    return out


def merge_features(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Several turns' (already shifted) features as one ``features`` object, items in order."""
    if not parts:
        return None
    merged: dict[str, Any] = {"mm_hashes": {}, "mm_placeholders": {}}
    optional = ("kwargs_data", "mm_metadata")
    has = {key: any(p.get(key) is not None for p in parts) for key in optional}
    for key in optional:
        if has[key]:
            merged[key] = {}
    for part in parts:
        hashes = part.get("mm_hashes") or {}
        for modality, items in hashes.items():
            merged["mm_hashes"].setdefault(modality, []).extend(items)
            merged["mm_placeholders"].setdefault(modality, []).extend(part["mm_placeholders"].get(modality, []))
            for key in optional:
                if has[key]:
                    values = (part.get(key) or {}).get(modality) or [None] * len(items)
                    merged[key].setdefault(modality, []).extend(values)
    return merged


class SessionFeatures:
    """Per-session multimodal features (shifted to session offsets)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[dict[str, Any]]] = {}

    def for_step(self, request: EngineRequest, step: TokenStep, prompt_len: int) -> list[dict[str, Any]]:
        fresh = request.reset or request.stateless
        parts = [] if fresh else list(self._parts.get(request.session_key, []))
        if step.multimodal:
            if "mm_hashes" not in step.multimodal or "mm_placeholders" not in step.multimodal:
                raise InvalidRequestError("multimodal must be the `features` object of /v1/chat/completions/render "
                                          "(mm_hashes, mm_placeholders, kwargs_data)")
            parts.append(shift_features(step.multimodal, prompt_len - len(step.token_ids)))
        return parts

    def commit(self, request: EngineRequest, parts: list[dict[str, Any]]) -> None:
        if request.stateless:
            return
        if parts:
            self._parts[request.session_key] = parts
        else:
            self._parts.pop(request.session_key, None)

    def drop(self, session_key: str) -> None:
        self._parts.pop(session_key, None)

    def copy(self, source_key: str, branch_keys: Sequence[str]) -> None:
        """Each branch gets the source's features (a fork)."""
        parts = self._parts.get(source_key)
        for key in branch_keys:
            if parts:
                self._parts[key] = list(parts)
            else:
                self._parts.pop(key, None)
