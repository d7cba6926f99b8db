"""The reference world model through ReferenceEngine: real torch, bitwise comparisons."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from schemas.errors import InvalidRequestError
from schemas.messages import Action, Observation, TokenStep, WorldStep
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.reference import WORLD_MODEL, ReferenceEngine, ReferenceEngineConfig
from workers.engines.reference_world import ReferenceWorldConfig, ReferenceWorldModel

SMALL = (1, 4, 2, 6, 10)


def image(seed: int, h: int = 24, w: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def step(i: int, *, seed: int | None = None, size: tuple[int, int] = (24, 32)) -> WorldStep:
    extra = {} if seed is None else {"seed": seed}
    obs = Observation(prompt=f"put the block {i} in the bowl",
                      images={"exterior": image(i, *size), "wrist": image(1000 + i)},
                      state=tuple(0.1 * (i + j) for j in range(8)), extra=extra)
    return WorldStep(observation=obs, action=Action(joint_positions=tuple(0.01 * i * j for j in range(7)),
                                                    gripper_position=(0.5,)))


def req(key: str, s: Any, **kwargs: Any) -> EngineRequest:
    return EngineRequest(session_key=key, model=WORLD_MODEL, step=s, **kwargs)


def latent(result: EngineOutput | BaseException) -> np.ndarray:
    assert isinstance(result, EngineOutput), result
    value = result.output["video_latent"]
    assert isinstance(value, np.ndarray)
    return value


def run(engine: ReferenceEngine, *requests: EngineRequest) -> list[np.ndarray]:
    return [latent(r) for r in engine.run_direct(WORLD_MODEL, list(requests))]


@pytest.fixture
def engine() -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))


def test_output_shape_dtype_and_context_length(engine: ReferenceEngine) -> None:
    first, second = (engine.run_direct(WORLD_MODEL, [req("a", step(i))])[0] for i in range(2))
    assert isinstance(first, EngineOutput) and isinstance(second, EngineOutput)
    assert latent(first).shape == SMALL and latent(first).dtype == np.float32
    assert np.isfinite(latent(first)).all() and np.abs(latent(first)).max() > 0
    assert (first.context_length, second.context_length) == (1, 2)


def test_default_latent_shape() -> None:
    out = run(ReferenceEngine(), req("a", step(0)))[0]
    assert out.shape == (1, 16, 2, 44, 80) and out.dtype == np.float32


def test_config_from_plain_options() -> None:
    from workers.engines.registry import build_engine

    engine = build_engine("reference", {"latent_shape": [2, 3], "lm": {"max_context": 128}})
    assert isinstance(engine, ReferenceEngine)
    assert engine.config.latent_shape == (2, 3) and engine.config.lm.max_context == 128
    assert run(engine, req("a", step(0)))[0].shape == (2, 3)


def test_deterministic_across_sessions_and_engines(engine: ReferenceEngine) -> None:
    a = [run(engine, req("a", step(i)))[0] for i in range(3)]
    b = [run(engine, req("b", step(i)))[0] for i in range(3)]
    other = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))
    c = [run(other, req("zzz", step(i)))[0] for i in range(3)]
    for x, y, z in zip(a, b, c, strict=True):
        assert x.tobytes() == y.tobytes() == z.tobytes()
    reseeded = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL, seed=1))
    assert run(reseeded, req("a", step(0)))[0].tobytes() != a[0].tobytes()


def test_output_depends_on_history(engine: ReferenceEngine) -> None:
    run(engine, req("a", step(1)))
    run(engine, req("b", step(2)))
    after_a, after_b = run(engine, req("a", step(9)), req("b", step(9)))
    assert not np.array_equal(after_a, after_b)
    fresh = run(engine, req("c", step(9)))[0]
    assert not np.array_equal(fresh, after_a)


def test_batch_invariance(engine: ReferenceEngine) -> None:
    alone = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))
    history = [run(alone, req("t", step(i)))[0] for i in range(2)]
    target = run(alone, req("t", step(5, seed=3)))[0]
    batched_history = []
    for i in range(2):
        outs = run(engine, req("x", step(40 + i, size=(7, 9))), req("t", step(i)), req("y", step(50 + i)),
                   req("z", step(60 + i, seed=i)), req("w", step(70 + i, size=(100, 3))))
        batched_history.append(outs[1])
    outs = run(engine, req("x", step(41)), req("y", step(42, seed=7)), req("z", step(43)),
               req("w", step(44, size=(1, 1))), req("t", step(5, seed=3)))
    for a, b in zip(history, batched_history, strict=True):
        assert a.tobytes() == b.tobytes()
    assert outs[4].tobytes() == target.tobytes()


def test_reset_starts_fresh(engine: ReferenceEngine) -> None:
    fresh = [run(engine, req("f", step(i)))[0] for i in (3, 4)]
    run(engine, req("a", step(1)))
    run(engine, req("a", step(2)))
    reset = run(engine, req("a", step(3), reset=True))[0]
    following = run(engine, req("a", step(4)))[0]
    assert reset.tobytes() == fresh[0].tobytes()
    assert following.tobytes() == fresh[1].tobytes()


def test_stateless_leaves_session_untouched(engine: ReferenceEngine) -> None:
    fresh = run(engine, req("f", step(7)))[0]
    reference = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))
    expected = [run(reference, req("a", step(i)))[0] for i in (1, 2)]
    run(engine, req("a", step(1)))
    stateless = engine.run_direct(WORLD_MODEL, [req("a", step(7), stateless=True)])[0]
    assert latent(stateless).tobytes() == fresh.tobytes()
    assert isinstance(stateless, EngineOutput) and stateless.context_length == 1
    assert run(engine, req("a", step(2)))[0].tobytes() == expected[1].tobytes()
    run(engine, req("s", step(1), stateless=True))
    assert "s" not in engine.session_keys()


def test_noise_seed(engine: ReferenceEngine) -> None:
    base, seeded, again, other = run(engine, req("a", step(1)), req("b", step(1, seed=5)),
                                     req("c", step(1, seed=5)), req("d", step(1, seed=6)))
    assert seeded.tobytes() == again.tobytes()
    assert not np.array_equal(base, seeded) and not np.array_equal(seeded, other)
    assert np.abs(seeded - base).max() < 0.1  # small noise


def test_read_only_images(engine: ReferenceEngine) -> None:
    frozen = image(3)
    frozen.flags.writeable = False
    out = run(engine, req("a", WorldStep(Observation(images={"cam": frozen}))))[0]
    assert out.tobytes() == run(engine, req("b", WorldStep(Observation(images={"cam": image(3)}))))[0].tobytes()


def test_camera_order_does_not_matter(engine: ReferenceEngine) -> None:
    images = {"b": image(1), "a": image(2, 5, 5)}
    flipped = dict(reversed(list(images.items())))
    one = WorldStep(Observation(prompt="p", images=images))
    two = WorldStep(Observation(prompt="p", images=flipped))
    renamed = WorldStep(Observation(prompt="p", images={"c": image(1), "a": image(2, 5, 5)}))
    x, y, z = run(engine, req("x", one), req("y", two), req("z", renamed))
    assert x.tobytes() == y.tobytes()
    assert not np.array_equal(x, z)


def test_invalid_requests_fail_alone(engine: ReferenceEngine) -> None:
    expected = run(ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL)), req("ok", step(1)))[0]
    run(engine, req("bad", step(0)))
    bad_seed = WorldStep(Observation(extra={"seed": "x"}))
    huge = WorldStep(Observation(state=(1e9,) * 8))
    results = engine.run_direct(WORLD_MODEL, [
        req("bad", bad_seed), req("ok", step(1)), req("bad2", huge),
        req("bad3", TokenStep(token_ids=(1, 2))), req("bad4", WorldStep(Observation(images={"x": image(0)[..., :2]}))),
    ])
    assert latent(results[1]).tobytes() == expected.tobytes()
    for index in (0, 2, 3, 4):
        assert isinstance(results[index], InvalidRequestError)
    # the failed step left session "bad" as it was: one committed step
    after = engine.run_direct(WORLD_MODEL, [req("bad", step(1))])[0]
    assert isinstance(after, EngineOutput) and after.context_length == 2
    assert set(engine.session_keys()) == {"bad", "ok"}


def test_unknown_model_and_drop_session(engine: ReferenceEngine) -> None:
    results = engine.run_direct("nope", [req("a", step(0)), req("b", step(0))])
    assert all(isinstance(r, InvalidRequestError) for r in results)
    first = run(engine, req("a", step(0)))[0]
    run(engine, req("a", step(1)))
    engine.drop_session("a")
    engine.drop_session("never-existed")
    assert run(engine, req("a", step(0)))[0].tobytes() == first.tobytes()


def test_same_session_twice_in_a_batch_runs_in_order(engine: ReferenceEngine) -> None:
    reference = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))
    expected = [run(reference, req("a", step(i)))[0] for i in range(2)]
    outs = engine.run_direct(WORLD_MODEL, [req("a", step(0)), req("b", step(5)), req("a", step(1))])
    assert latent(outs[0]).tobytes() == expected[0].tobytes()
    assert latent(outs[2]).tobytes() == expected[1].tobytes()
    assert isinstance(outs[2], EngineOutput) and outs[2].context_length == 2


async def test_run_batch_is_async_and_matches_direct(engine: ReferenceEngine) -> None:
    await engine.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    batches = await asyncio.gather(*(engine.run_batch(WORLD_MODEL, [req(f"s{i}", step(i))]) for i in range(4)))
    task.cancel()
    assert ticks > 1
    direct = ReferenceEngine(ReferenceEngineConfig(latent_shape=SMALL))
    for i, results in enumerate(batches):
        assert latent(results[0]).tobytes() == run(direct, req("d", step(i), stateless=True))[0].tobytes()
    assert engine.models()[WORLD_MODEL].value == "world_model_env"
    await engine.close()


def test_model_api_directly() -> None:
    model = ReferenceWorldModel(ReferenceWorldConfig(latent_shape=(2, 3)), seed=0)
    (out, h1), = model.step_batch([(None, step(0))])
    (again, h2), = model.step_batch([(h1, step(0))])
    assert out.shape == (2, 3) and out.dtype == np.float32
    assert not np.array_equal(out, again) and h1.shape == h2.shape == (64,)
    with pytest.raises(InvalidRequestError):
        model.step_batch([(None, step(0)), (None, WorldStep(Observation(state=(1.0,) * 3)))])
