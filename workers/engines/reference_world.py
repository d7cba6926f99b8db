"""A small deterministic world model: the CPU stand-in for a DreamZero-style latent world model.

Per session it keeps a hidden vector ``h`` (zeros at the start). One step encodes the observation
and action into features ``x`` and updates ``h' = tanh(W_h h + W_x x + b)``; the latent is
``sum_k h'[k] * P_k`` over fixed random patterns ``P_k`` of the latent shape, plus small seeded
noise when ``observation.extra["seed"]`` is given. So every latent depends on the whole history of
its session. All weights come from one model seed; every reduction is batch invariant (see
``torch_ops``), so a step's latent is bitwise the same alone or in any batch.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from schemas.errors import InvalidRequestError
from schemas.messages import GRIPPER_COUNT, JOINT_COUNT, StepInput, WorldStep
from workers.engines import torch_ops

_SEED_KEY = "seed"
_MAX_SEED = 1 << 63
_MAX_CACHED_PROJECTIONS = 256


@dataclass(frozen=True)
class ReferenceWorldConfig:
    """Architecture of the reference world model (weights come from the model seed)."""

    latent_shape: tuple[int, ...] = (1, 16, 2, 44, 80)
    hidden_size: int = 64
    pool_size: int = 4  # images are average-pooled to pool_size x pool_size per channel
    prompt_bins: int = 64  # byte histogram of the prompt
    noise_scale: float = 0.01  # std of the seeded latent noise
    max_abs_state: float = 1e4  # larger joint/gripper values are rejected

    def __post_init__(self) -> None:
        if not self.latent_shape or any(d <= 0 for d in self.latent_shape):
            raise ValueError(f"latent_shape must be non-empty and positive, got {self.latent_shape}")
        if self.hidden_size <= 0 or self.pool_size <= 0 or self.prompt_bins <= 0:
            raise ValueError("hidden_size, pool_size and prompt_bins must be positive")

    @property
    def image_features(self) -> int:
        return 3 * self.pool_size * self.pool_size

    @property
    def input_features(self) -> int:
        return self.hidden_size + JOINT_COUNT + GRIPPER_COUNT + self.prompt_bins

    @property
    def latent_size(self) -> int:
        return math.prod(self.latent_shape)


@dataclass(frozen=True)
class PreparedWorldStep:
    """A validated step: its input vector and optional noise seed."""

    features: torch.Tensor
    noise_seed: int | None


class ReferenceWorldModel:
    """The model; holds weights only. Session state (``h``) is passed in and returned."""

    def __init__(self, config: ReferenceWorldConfig | None = None, *, seed: int = 0,
                 device: str = "cpu") -> None:
        self.config = config or ReferenceWorldConfig()
        self.seed = seed
        self.device = torch.device(device)
        cfg = self.config
        gen = torch_ops.seeded_generator(seed)
        hidden = cfg.hidden_size

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        self.w_h = rand(hidden, hidden, scale=0.9 / math.sqrt(hidden))
        self.w_x = rand(hidden, cfg.input_features, scale=1.5 / math.sqrt(cfg.input_features))
        self.bias = rand(hidden, scale=0.1)
        self.patterns = rand(hidden, cfg.latent_size, scale=1.0 / math.sqrt(hidden))
        self._projections: dict[str, torch.Tensor] = {}

    def reseed_projections(self, seed: int) -> None:
        """Per-camera projections are derived from the seed on demand; new weights bring a new seed."""
        self.seed = seed
        self._projections.clear()

    def initial_state(self) -> torch.Tensor:
        """The hidden state of a fresh session."""
        return torch.zeros(self.config.hidden_size, device=self.device)

    # ------------------------------------------------------------------ features

    def _image_projection(self, name: str) -> torch.Tensor:
        """Per-camera projection (hidden, 48), seeded by the model seed and the camera name."""
        cached = self._projections.get(name)
        if cached is not None:
            return cached
        cfg = self.config
        mixed = (self.seed * 0x9E3779B1 + zlib.crc32(name.encode("utf-8"))) % _MAX_SEED
        gen = torch_ops.seeded_generator(mixed)
        scale = 1.0 / math.sqrt(cfg.image_features)
        weight = (torch.randn(cfg.hidden_size, cfg.image_features, generator=gen) * scale).to(self.device)
        if len(self._projections) >= _MAX_CACHED_PROJECTIONS:
            self._projections.clear()
        self._projections[name] = weight
        return weight

    def _image_features(self, step: WorldStep) -> torch.Tensor:
        cfg = self.config
        total = torch.zeros(cfg.hidden_size, device=self.device)
        for name in sorted(step.observation.images):
            image = step.observation.images[name]
            if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                    or image.shape[2] != 3 or 0 in image.shape:
                raise InvalidRequestError(f"image {name!r} must be a non-empty uint8 HxWx3 array")
            # A copy: wire-decoded arrays are often read-only views, which torch.from_numpy warns about.
            pixels = torch.from_numpy(np.array(image, dtype=np.uint8, order="C", copy=True)).to(self.device)
            chw = (pixels.permute(2, 0, 1).to(torch.float32) / 255.0).contiguous()
            pooled = F.adaptive_avg_pool2d(chw.unsqueeze(0), cfg.pool_size).reshape(-1)
            total = total + torch_ops.linear(pooled, self._image_projection(name))
        return total

    def _state_features(self, step: WorldStep) -> list[float]:
        joints, gripper = step.robot_state()
        values = [*joints, *gripper]
        if len(joints) != JOINT_COUNT or len(gripper) != GRIPPER_COUNT:
            raise InvalidRequestError(f"robot state must be {JOINT_COUNT} joints + {GRIPPER_COUNT} gripper")
        limit = self.config.max_abs_state
        if not all(math.isfinite(v) and abs(v) <= limit for v in values):
            raise InvalidRequestError(f"joint and gripper values must be finite with |v| <= {limit:g}")
        return values

    def _prompt_features(self, step: WorldStep) -> list[float]:
        prompt = step.observation.prompt
        if not isinstance(prompt, str):
            raise InvalidRequestError("observation.prompt must be a string")
        bins = self.config.prompt_bins
        counts = [0] * bins
        data = prompt.encode("utf-8")
        for byte in data:
            counts[byte * bins // 256] += 1
        return [c / len(data) for c in counts] if data else [0.0] * bins

    def _noise_seed(self, step: WorldStep) -> int | None:
        seed = step.observation.extra.get(_SEED_KEY)
        if seed is None:
            return None
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
            raise InvalidRequestError(f"observation.extra.seed must be an integer in [0, 2**63), got {seed!r}")
        return seed

    def prepare(self, step: StepInput) -> PreparedWorldStep:
        """Validate one step and compute its inputs; raises InvalidRequestError for unusable input."""
        if not isinstance(step, WorldStep):
            raise InvalidRequestError(f"the world model takes world steps, got {type(step).__name__}")
        tail = torch.tensor(self._state_features(step) + self._prompt_features(step), dtype=torch.float32)
        features = torch.cat([self._image_features(step), tail.to(self.device)])
        return PreparedWorldStep(features=features, noise_seed=self._noise_seed(step))

    def check_state(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` if it is a hidden state of this model, else InvalidRequestError."""
        if not isinstance(h, torch.Tensor) or h.shape != (self.config.hidden_size,) \
                or h.dtype != torch.float32:
            raise InvalidRequestError("session state does not belong to this world model")
        return h.to(self.device)

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(
        self, items: Sequence[tuple[torch.Tensor | None, PreparedWorldStep]]
    ) -> list[tuple[np.ndarray, torch.Tensor]]:
        """One forward pass over many sessions: ``(prev_h or None, prepared step)`` in,
        ``(latent float32 ndarray of latent_shape, new_h)`` out, in order."""
        if not items:
            return []
        xs = torch.stack([prepared.features for _, prepared in items])
        hs = torch.stack([self.initial_state() if h is None else self.check_state(h) for h, _ in items])
        pre = torch_ops.linear(hs, self.w_h) + torch_ops.linear(xs, self.w_x) + self.bias
        new_h = torch_ops.pointwise(torch.tanh, pre)
        latents = self._latents(new_h, [prepared.noise_seed for _, prepared in items])
        shape = self.config.latent_shape
        return [(latents[i].reshape(shape).cpu().numpy(), new_h[i].clone()) for i in range(len(items))]

    def step_batch(
        self, items: Sequence[tuple[torch.Tensor | None, WorldStep]]
    ) -> list[tuple[np.ndarray, torch.Tensor]]:
        """``forward`` on raw steps; the first invalid step raises before anything runs."""
        return self.forward([(h, self.prepare(step)) for h, step in items])

    def _latents(self, new_h: torch.Tensor, seeds: Sequence[int | None]) -> torch.Tensor:
        """``sum_k h'[:, k] * P_k`` as a fixed-order sequence of exact elementwise multiplies and
        adds, so each row's bits are independent of the batch; then the seeded noise."""
        acc = new_h[:, :1] * self.patterns[0]
        term = torch.empty_like(acc)
        for k in range(1, self.config.hidden_size):
            torch.mul(new_h[:, k : k + 1], self.patterns[k], out=term)
            acc.add_(term)
        for i, seed in enumerate(seeds):
            if seed is not None:
                gen = torch_ops.seeded_generator(seed)
                noise = torch.randn(self.config.latent_size, generator=gen) * self.config.noise_scale
                acc[i] = acc[i] + noise.to(self.device)
        return acc
