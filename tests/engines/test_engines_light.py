"""The real engines' parts that need neither vllm nor vllm_omni (they run in the fast tier too):
the registry, HTTP error mapping, multimodal feature offsets, latent decoding, lazy imports, and
what a weight reload says when a server cannot do it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import Any

import httpx
import numpy as np
import pytest

from schemas.errors import InvalidRequestError, TransientEngineError
from schemas.messages import TokenStep, WorldStep
from workers.engines.base import EngineRequest
from workers.engines.http_common import check_rpc_results
from workers.engines.mm_features import merge_features, shift_features
from workers.engines.null import NullEngine
from workers.engines.registry import ENGINES, REAL_ENGINES, build_engine
from workers.engines.vllm_engine import VLLMEngine
from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine, stop_string_at_end, top_from_content
from workers.engines.vllm_omni_engine import VLLMOmniEngine, robot_obs
from workers.engines.vllm_omni_http import VLLMOmniHTTPConfig, VLLMOmniHTTPEngine, decode_latent, step_body

TURN = {"token_ids": [1, 5, 205], "sampling": {"max_tokens": 4, "seed": 7}}


def test_registry_builds_each_engine_without_importing_vllm() -> None:
    assert isinstance(build_engine("vllm", {"model": "/models/tiny"}), VLLMEngine)
    assert isinstance(build_engine("vllm-http", {"base_url": "http://x", "model": "m"}), VLLMHTTPEngine)
    assert isinstance(build_engine("vllm-omni", {"model": "dreamzero"}), VLLMOmniEngine)
    assert isinstance(build_engine("vllm-omni-http", {"base_url": "http://x"}), VLLMOmniHTTPEngine)
    assert build_engine("vllm", {"model": "/models/tiny/"}).models() == {"tiny": "tokens"}
    with pytest.raises(ValueError, match="unknown engine"):
        build_engine("nope")
    with pytest.raises(ValueError, match="vllm-http"):
        build_engine("vllm-http", {"model": "m"})  # base_url missing
    assert len(REAL_ENGINES) == 4
    assert set(REAL_ENGINES) < set(ENGINES)


def test_registry_builds_an_engine_named_by_module_and_class() -> None:
    engine = build_engine("workers.engines.null:NullEngine", {"delay_ms": 5})
    assert isinstance(engine, NullEngine) and engine.config.delay_ms == 5
    with pytest.raises(ValueError, match="NullEngineConfig"):
        build_engine("workers.engines.null:NullEngine", {"bogus": 1})
    with pytest.raises(ValueError, match="not an Engine subclass"):
        build_engine("workers.engines.null:NullEngineConfig")
    with pytest.raises(ValueError, match="no_such_module"):
        build_engine("no_such_module:Engine")
    with pytest.raises(ValueError, match="unknown engine"):
        build_engine("workers.engines.null:")


def test_engine_modules_import_no_heavy_library() -> None:
    code = ("import sys, workers.engines.registry, workers.engines.vllm_engine, workers.engines.vllm_http, "
            "workers.engines.vllm_omni_engine, workers.engines.vllm_omni_http, bench.world_standin, "
            "workers.engines.http_common, workers.engines.token_sessions\n"
            "heavy = [m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


async def answer_with(code: int) -> Any:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, json={"error": {"message": f"status {code}", "code": code}})

    engine = VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://test", model="m"), transport=httpx.MockTransport(answer))
    out = (await engine.run_batch("m", [EngineRequest("s", "m", TokenStep.from_wire(TURN), reset=True)]))[0]
    assert engine.context("s") is None  # a failed step changes nothing
    await engine.close()
    return out


@pytest.mark.asyncio
async def test_http_status_codes_map_to_fleet_errors() -> None:
    for code in (400, 404, 422):
        assert isinstance(await answer_with(code), InvalidRequestError), code
    for code in (408, 429, 500, 503):
        assert isinstance(await answer_with(code), TransientEngineError), code


@pytest.mark.asyncio
async def test_unreachable_server_is_transient() -> None:
    engine = VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://127.0.0.1:9", model="m", timeout_s=2.0))
    out = await engine.run_batch("m", [EngineRequest("s", "m", TokenStep.from_wire(TURN), reset=True)])
    assert isinstance(out[0], TransientEngineError)
    await engine.close()


def listed(*pairs: tuple[int, float]) -> dict[str, Any]:
    """One position of the server's logprobs content (the sampled token listed first)."""
    return {"top_logprobs": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in pairs]}


def test_top_k_from_the_servers_k_plus_one_list() -> None:
    # Sampled token 7 outside the top 2: the server lists it first, then the top 2 in rank order.
    assert top_from_content(listed((7, -5.0), (3, -1.0), (4, -2.0)), 2) == [[3, -1.0], [4, -2.0]]
    # Sampled token 4 ranked second: the list is the top 3, the sampled token moved to the front.
    assert top_from_content(listed((4, -2.0), (3, -1.0), (9, -3.0)), 2) == [[3, -1.0], [4, -2.0]]
    assert top_from_content(listed((3, -1.0), (4, -2.0), (9, -3.0)), 2) == [[3, -1.0], [4, -2.0]]
    with pytest.raises(TransientEngineError, match="token name"):
        top_from_content({"top_logprobs": [{"token": "abc", "logprob": -1.0}]}, 1)


def test_stop_string_named_as_vllm_names_it() -> None:
    assert stop_string_at_end("xpef", "xp", ["never", "pef"]) == "pef"  # completed across two tokens
    assert stop_string_at_end("pefab", "pef", ["pef"]) is None  # completed earlier, not by this token
    assert stop_string_at_end("abcd", "ab", ["cd", "bc"]) == "bc"  # the one that completes first
    assert stop_string_at_end("ab", "ab", ["b"]) is None  # the last token added no text


@pytest.mark.asyncio
async def test_http_step_reports_top_logprobs_and_the_stop_string() -> None:
    seen: list[Any] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": {2: "ab", 1: "a"}[len(body["tokens"])]})
        content = [{"logprob": -1.0, **listed((10, -1.0), (11, -2.0))},
                   {"logprob": -3.0, **listed((12, -3.0), (10, -0.5), (11, -2.5))}]
        return httpx.Response(200, json={"choices": [{"token_ids": [10, 12], "finish_reason": "stop",
                                                      "logprobs": {"content": content}}]})

    engine = VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://test", model="m"), transport=httpx.MockTransport(answer))
    step = TokenStep.from_wire({"token_ids": [1], "sampling": {"max_tokens": 4, "logprobs": 2, "stop": ["b"]}})
    out = (await engine.run_batch("m", [EngineRequest("s", "m", step, reset=True)]))[0]
    assert not isinstance(out, BaseException), out
    assert out.output["top_logprobs"] == [[[10, -1.0], [11, -2.0]], [[10, -0.5], [11, -2.5]]]
    assert out.output["stop_reason"] == "b" and seen[0][1]["sampling_params"]["logprobs"] == 3
    await engine.close()


def test_multimodal_features_move_to_session_offsets() -> None:
    a = {"mm_hashes": {"image": ["h1"]}, "mm_placeholders": {"image": [{"offset": 2, "length": 4}]},
         "kwargs_data": {"image": ["d1"]}}
    b = {"mm_hashes": {"image": ["h2"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 4}]}}
    merged = merge_features([shift_features(a, 0), shift_features(b, 20)])
    assert merged == {"mm_hashes": {"image": ["h1", "h2"]},
                      "mm_placeholders": {"image": [{"offset": 2, "length": 4}, {"offset": 21, "length": 4}]},
                      "kwargs_data": {"image": ["d1", None]}}
    assert merge_features([]) is None


def world(extra: dict[str, Any] | None = None) -> WorldStep:
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    return WorldStep.from_wire({"observation": {"prompt": "p", "images": {"cam": image}, "state": [0.5] * 8,
                                                "extra": extra or {}}})


def test_robot_obs_and_step_body_use_the_droid_layout() -> None:
    obs = robot_obs(world({"observation/extra_key": 1, "other": 2}), default_seed=3)
    assert obs["observation/joint_position"].tolist() == [0.5] * 7
    assert obs["observation/gripper_position"].tolist() == [0.5]
    assert obs["seed"] == 3 and obs["observation/extra_key"] == 1 and "other" not in obs
    assert robot_obs(world({"seed": 9}), default_seed=3)["seed"] == 9
    body = step_body(world(), 4, True, default_seed=5)
    assert body["step_id"] == 4 and body["observation"]["extra"] == {"seed": 5}
    assert body["action"]["joint_positions"] == [0.5] * 7 and body["observation"]["images"]["cam"][0][0] == [0, 1, 2]


def test_latents_decode_from_base64_raw_tensors() -> None:
    latent = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    answer = {"video_latent": base64.b64encode(latent.tobytes()).decode(), "shape": [1, 2, 3, 4],
              "dtype": "float32", "encoding": "base64_raw_tensor"}
    out = decode_latent(answer)
    assert out.dtype == np.float32 and np.array_equal(out, latent) and out.flags.writeable
    with pytest.raises(TransientEngineError):
        decode_latent({"encoding": "string", "video_latent": "x"})


@pytest.mark.asyncio
async def test_a_server_without_development_routes_says_how_to_enable_weight_reloads() -> None:
    paths: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    transport = httpx.MockTransport(answer)
    for engine in (VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://test", model="m"), transport=transport),
                   VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(base_url="http://test"), transport=transport)):
        await engine.start()
        assert engine.policy_version == 0
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            await engine.load_weights("/ckpt", 1)
        assert engine.policy_version == 0
        await engine.close()
    assert "/collective_rpc" not in paths  # nothing is reloaded on a server that was not paused


def test_collective_rpc_results_of_stages_without_the_method_fail() -> None:
    check_rpc_results([None, None], "reload_weights")
    check_rpc_results(None, "reload_weights")
    with pytest.raises(RuntimeError, match=r"worker 1 .*todo"):
        check_rpc_results([None, {"todo": "diffusion stage"}], "reload_weights")


def test_a_step_without_state_or_action_values_invents_no_robot_state() -> None:
    bare = WorldStep.from_wire({"observation": {"prompt": "p"}, "action": {}})
    obs = robot_obs(bare)
    assert "observation/joint_position" not in obs and "observation/gripper_position" not in obs
    body = step_body(bare, 0, True)
    assert body["action"]["joint_positions"] is None and body["action"]["gripper_position"] is None
    split = robot_obs(WorldStep.from_wire({"observation": {"state": [float(i) for i in range(8)]}, "action": {}}))
    assert split["observation/joint_position"].tolist() == list(range(7))
    assert split["observation/gripper_position"].tolist() == [7.0]
