"""Weights of the reference engines as a flat state dict: every tensor reachable from a model
object (attributes, lists, dicts), named by its path. Lets the engines save and load weights the
way a real engine reloads a checkpoint, without tying the models to nn.Module."""

from __future__ import annotations

from typing import Any

import torch


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(tensors(value, f"{prefix}{key}."))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            out.update(tensors(value, f"{prefix}{index}."))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.device, torch.Generator, type)):
        for key, value in vars(obj).items():
            if not key.startswith("_"):  # private attributes are caches derived from the weights
                out.update(tensors(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def check_state(obj: Any, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` has exactly the tensors of ``obj``, shapes and dtypes."""
    current = tensors(obj)
    missing = sorted(set(current) - set(state))
    unknown = sorted(set(state) - set(current))
    if missing or unknown:
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, unknown {unknown[:3]}")
    for name, tensor in current.items():
        new = state[name]
        if new.shape != tensor.shape or new.dtype != tensor.dtype:
            raise ValueError(f"weight {name}: expected {tuple(tensor.shape)} {tensor.dtype}, "
                             f"got {tuple(new.shape)} {new.dtype}")


def copy_state(obj: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy a checked ``state`` into the tensors of ``obj``, in place."""
    current = tensors(obj)
    with torch.no_grad():
        for name, tensor in current.items():
            tensor.copy_(state[name].to(tensor.device))
