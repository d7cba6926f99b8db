"""The length checks on a filled vime ``Sample``: vime's trainer slices ``tokens`` by
``response_length`` and zips the response with ``loss_mask`` / ``rollout_log_probs`` (and the routed
experts with the tokens), so a field that disagrees would train on misaligned data without an error.
Checked once, before the sample is handed back."""

from __future__ import annotations

from typing import Any


class SampleLengthError(ValueError):
    """A filled sample whose fields disagree in length; the message names the field."""


def _length(name: str, value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        raise SampleLengthError(f"sample.{name} has no length (got {type(value).__name__})") from None


def _check_response(sample: Any) -> None:
    tokens = _length("tokens", sample.tokens)
    response_length = sample.response_length
    if not isinstance(response_length, int) or not 0 <= response_length <= tokens:
        raise SampleLengthError(f"sample.response_length={response_length!r} is not within the {tokens} tokens")
    for name in ("loss_mask", "rollout_log_probs"):
        count = _length(name, getattr(sample, name))
        if count != response_length:
            raise SampleLengthError(f"sample.{name} has {count} entries for a response of {response_length} tokens")
    if any(bit not in (0, 1) for bit in sample.loss_mask):
        raise SampleLengthError("sample.loss_mask holds values other than 0 and 1")


def _check_rest(sample: Any) -> None:
    status_type = type(sample).Status
    if not isinstance(sample.status, status_type) or sample.status == status_type.PENDING:
        raise SampleLengthError(f"sample.status {sample.status!r} is not a finished status")
    versions = sample.weight_versions
    if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
        raise SampleLengthError("sample.weight_versions must list the policy version (str) of each turn")
    experts = getattr(sample, "rollout_routed_experts", None)
    if experts is not None:
        shape = tuple(getattr(experts, "shape", ()))
        if len(shape) != 3 or shape[0] != len(sample.tokens) - 1:
            raise SampleLengthError(f"sample.rollout_routed_experts is {shape}; expected "
                                    f"({len(sample.tokens) - 1}, layers, top_k): one row per token but the last")
    train_inputs = getattr(sample, "multimodal_train_inputs", None)
    if train_inputs is not None and not isinstance(train_inputs, dict):
        raise SampleLengthError("sample.multimodal_train_inputs must be a dict of processor outputs")


def check_sample(sample: Any) -> Any:
    """``sample`` unchanged when its fields agree, else :class:`SampleLengthError`."""
    _check_response(sample)
    _check_rest(sample)
    return sample
