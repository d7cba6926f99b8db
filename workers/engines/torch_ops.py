"""Batch-invariant torch helpers for the reference engines.

The fleet promises that a request's output does not depend on what else is in its batch, bit for
bit. Plain torch ops do not promise that:

- ``x @ w.T`` hands the whole (M, K) x (K, N) product to BLAS, which picks a different kernel
  (blocking, vector width, K-splitting) for different M, so row i's bits change with the batch
  size. ``linear`` below multiplies elementwise (exact per element) and reduces over the last,
  contiguous dimension with ``sum(-1)``: every output element is the reduction of one contiguous
  row of ``in_features`` products, done by the same inner-reduction code whatever the number of
  rows. Rows are processed in chunks to bound memory; chunking cannot change any row's bits.
- Unary kernels (``exp``, ``tanh``, ``silu`` ...) run a SIMD implementation over full vectors and a
  scalar implementation (a different libm routine) over the tail of the flattened tensor. Whether an
  element falls in that tail depends on the total size, i.e. on the batch. ``pointwise`` pads the
  last dimension to a multiple of 64 elements so no element is ever in a tail.
- Multi-threaded reductions split work by the total size: the engine runs torch single-threaded.

Attention is the exception that may use matmul: it runs per session, on fresh contiguous tensors
whose shapes depend on that session alone, so BLAS sees the same problem whatever the batch.

Everything here is verified bitwise on CPU. On CUDA the reduction launch configuration may depend on
the number of rows, so batch invariance there is best effort.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Elements per temporary product tensor in ``linear`` (16 MiB of float32).
_CHUNK_ELEMENTS = 1 << 22
# A multiple of the widest SIMD loop (2 x AVX-512 float vectors = 32), with room to spare.
_LANE_MULTIPLE = 64


def seeded_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``seed`` (0 <= seed < 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with each output row's bits independent of the number of rows.

    ``x``: (..., in), ``weight``: (out, in), ``bias``: (out,). See the module docstring for why
    this is an elementwise product plus a last-dimension sum rather than a matmul.
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {in_features}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features)
    step = max(1, _CHUNK_ELEMENTS // max(1, out_features * in_features))
    pieces = [
        (rows[start : start + step].unsqueeze(-2) * weight).sum(-1)
        for start in range(0, rows.shape[0], step)
    ]
    out = torch.cat(pieces) if pieces else rows.new_zeros((0, out_features))
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, out_features)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, padded so every element takes the SIMD path."""
    if x.dim() == 0:
        return pointwise(fn, x.reshape(1)).reshape(())
    width = x.shape[-1]
    padded = F.pad(x, (0, (-width) % _LANE_MULTIPLE)).contiguous()
    return fn(padded)[..., :width].contiguous()


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMS norm from inner reductions, ``sqrt`` and division (all correctly rounded)."""
    mean_square = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(mean_square + eps) * gain


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, batch invariant (``pointwise`` exp, inner-dim sum)."""
    shifted = x - x.max(dim=-1, keepdim=True).values
    exp = pointwise(torch.exp, shifted)
    return exp / exp.sum(-1, keepdim=True)
