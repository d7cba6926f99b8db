"""World-model step input: the DROID observation and action of the vLLM-Omni rollout API."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.records import quick_init
from schemas.wire_fields import as_extra, as_floats, as_image, as_mapping, check_fields, or_default

JOINT_COUNT = 7  # DROID arm joints
GRIPPER_COUNT = 1
_OBSERVATION_FIELDS = frozenset({"prompt", "images", "state", "extra"})
_ACTION_FIELDS = frozenset({"joint_positions", "gripper_position", "extra"})
_STEP_FIELDS = frozenset({"observation", "action"})


@quick_init
@dataclass(frozen=True)
class Observation:
    """What the environment saw: the DROID layout of the vLLM-Omni rollout API."""

    prompt: str = ""
    images: Mapping[str, np.ndarray] = field(default_factory=dict)
    state: tuple[float, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> Observation:
        data = as_mapping(data, "observation")
        check_fields(data, _OBSERVATION_FIELDS, "observation")
        prompt = data.get("prompt", "")
        if not isinstance(prompt, str):
            raise InvalidRequestError("observation.prompt must be a string")
        images_in = as_mapping(or_default(data.get("images"), {}), "observation.images")
        if len(images_in) > limits.max_images:
            raise PayloadTooLargeError(f"{len(images_in)} images; limit is {limits.max_images}")
        images = {str(k): as_image(v, str(k)) for k, v in images_in.items()} if images_in else {}
        state = as_floats(or_default(data.get("state"), ()), "observation.state")
        return cls(prompt, images, state, as_extra(data.get("extra"), "extra"))

    def to_wire(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "images": dict(self.images), "state": list(self.state),
                "extra": dict(self.extra)}


@quick_init
@dataclass(frozen=True)
class Action:
    """The commanded action: 7 joint positions and 1 gripper position (DROID)."""

    joint_positions: tuple[float, ...] | None = None
    gripper_position: tuple[float, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any) -> Action:
        data = as_mapping(data, "action")
        check_fields(data, _ACTION_FIELDS, "action")
        joints = data.get("joint_positions")
        gripper = data.get("gripper_position")
        return cls(
            joint_positions=None if joints is None else as_floats(joints, "joint_positions", count=JOINT_COUNT),
            gripper_position=None
            if gripper is None
            else as_floats(gripper, "gripper_position", count=GRIPPER_COUNT),
            extra=as_extra(data.get("extra"), "action.extra"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "joint_positions": None if self.joint_positions is None else list(self.joint_positions),
            "gripper_position": None if self.gripper_position is None else list(self.gripper_position),
            "extra": dict(self.extra),
        }


@quick_init
@dataclass(frozen=True)
class WorldStep:
    """Input of one world-model step. Joints/gripper fall back to ``observation.state``."""

    observation: Observation
    action: Action | None = None

    def robot_state(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(7 joint positions, 1 gripper position), zeros for what the step leaves out: for engines
        that need numbers (the reference world's features), never for what reaches vLLM-Omni."""
        joints, gripper = self.given_robot_state()
        return joints or (0.0,) * JOINT_COUNT, gripper or (0.0,) * GRIPPER_COUNT

    def given_robot_state(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """(7 joint positions, 1 gripper position) as the DROID mapping of the reference picks them;
        None where the step gives neither an action value nor a state, as upstream leaves the key out."""
        joints = self.action.joint_positions if self.action else None
        gripper = self.action.gripper_position if self.action else None
        state = self.observation.state
        if joints is None and state:
            if len(state) < JOINT_COUNT:
                raise InvalidRequestError(
                    f"observation.state must hold at least 7 joint values, got {len(state)}"
                )
            joints = state[:JOINT_COUNT]
            if gripper is None and len(state) > JOINT_COUNT:
                gripper = state[JOINT_COUNT : JOINT_COUNT + GRIPPER_COUNT]
        return joints, gripper

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> WorldStep:
        data = as_mapping(data, "world step")
        check_fields(data, _STEP_FIELDS, "world step")
        if "observation" not in data:
            raise InvalidRequestError("world step needs an observation")
        action = data.get("action")
        step = cls(Observation.from_wire(data["observation"], limits),
                   None if action is None else Action.from_wire(action))
        step.robot_state()  # validates the state fallback early
        return step

    def to_wire(self) -> dict[str, Any]:
        return {"observation": self.observation.to_wire(),
                "action": None if self.action is None else self.action.to_wire()}
