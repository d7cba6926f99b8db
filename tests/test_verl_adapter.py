"""The verl server manager on a real fleet, without verl installed (the verl tier, tests/verl/, runs
verl's own agent loops through it): sticky sessions per request_id, only new tokens sent, a rewritten
history on a fresh session, verl's sampling params mapped or refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker import FleetClient
from broker.integrations.verl import FleetServerManager, FleetSettings, VerlFleetError, fleet_sampling
from schemas.reference_tokenizer import ReferenceTokenizer
from tests.support import WorkerPool
from tests.test_multiturn import reference_engine

TOK = ReferenceTokenizer()
# What verl's AgentLoopWorker sends (rollout config defaults), greedy so that runs compare.
VERL_PARAMS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def fields(output: Any) -> dict[str, Any]:
    """TokenOutput's fields (a dict without verl, the pydantic model with it)."""
    return output if isinstance(output, dict) else dict(output.model_dump())


def prompt(text: str) -> list[int]:
    ids = TOK.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert isinstance(ids, list)
    return ids


@pytest.fixture
async def manager(fleet: FleetClient, workers: WorkerPool) -> AsyncIterator[FleetServerManager]:
    await workers.add(reference_engine())
    server = FleetServerManager(FleetSettings(), fleet=fleet, response_length=12)
    yield server
    await server.aclose()


def test_sampling_params_map_or_are_refused() -> None:
    assert fleet_sampling(VERL_PARAMS, 64) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64}
    assert fleet_sampling({"max_new_tokens": 5, "stop_token_ids": [1], "seed": 3}, 64) == {
        "max_tokens": 5, "stop_token_ids": [1], "seed": 3}
    passed = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_tokens": 2,
              "stop": ["x y"]}
    assert fleet_sampling({**VERL_PARAMS, **passed}, 64) == {**fleet_sampling(VERL_PARAMS, 64), **passed}
    for bad in ({"n": 2}, {"logprobs": 5}, {"beam_width": 2}):
        with pytest.raises(ValueError, match="sampling_params"):
            fleet_sampling(bad)
    with pytest.raises(ValueError, match="unknown fleet settings"):
        FleetSettings.from_kwargs({"fleet_modle": "x"})
    assert FleetSettings.from_kwargs({"fleet_model": "m", "fleet_cell": None, "other": 1}).model == "m"


async def test_stop_strings_and_penalties_reach_the_engine(manager: FleetServerManager) -> None:
    """A stop string of the greedy answer ends the turn there, named in ``extra_fields``; a penalty
    (negative: repeats are favoured) changes the greedy answer."""
    full = fields(await manager.generate("a", prompt_ids=prompt("stop"), sampling_params=VERL_PARAMS))
    text = TOK.decode(full["token_ids"])
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isprintable())
    cut = fields(await manager.generate("b", prompt_ids=prompt("stop"), sampling_params={**VERL_PARAMS,
                                                                                    "stop": [stop]}))
    assert cut["extra_fields"]["finish_reason"] == "stop" and cut["extra_fields"]["stop_reason"] == stop
    assert TOK.decode(cut["token_ids"]).endswith(stop) and full["extra_fields"]["stop_reason"] is None
    penalized = fields(await manager.generate("c", prompt_ids=prompt("stop"),
                                              sampling_params={**VERL_PARAMS, "presence_penalty": -2.0}))
    assert penalized["token_ids"] != full["token_ids"]


async def test_turns_of_a_request_share_a_session_and_send_only_new_tokens(
        manager: FleetServerManager, fleet: FleetClient) -> None:
    first_prompt = prompt("2 + 2?")
    first = fields(await manager.generate("r1", prompt_ids=first_prompt, sampling_params=VERL_PARAMS))
    assert first["token_ids"] and len(first["log_probs"]) == len(first["token_ids"]) <= 12
    assert first["stop_reason"] == "completed" and first["extra_fields"]["finish_reason"] in ("stop", "length")
    tool_turn = TOK.encode("<|user|>tool says 4<|eos|><|assistant|>")
    second_prompt = [*first_prompt, *first["token_ids"], *tool_turn]
    second = fields(await manager.generate("r1", prompt_ids=second_prompt, sampling_params=VERL_PARAMS))
    session_id = first["extra_fields"]["fleet_session_id"]
    assert second["extra_fields"]["fleet_session_id"] == session_id
    status = await fleet.status(session_id)
    assert (status.committed_step_id, status.context_length) == (1, len(second_prompt) + len(second["token_ids"]))
    # The same history sent whole to a fresh session generates the same tokens: the context is right.
    fresh = fields(await manager.generate("r2", prompt_ids=second_prompt, sampling_params=VERL_PARAMS))
    assert fresh["token_ids"] == second["token_ids"] and fresh["log_probs"] == pytest.approx(second["log_probs"])
    assert fresh["extra_fields"]["fleet_session_id"] != session_id
    assert sorted(manager.open_requests) == ["r1", "r2"]
    await manager.aclose()
    assert manager.open_requests == [] and (await fleet.status(session_id)).closed


async def test_a_rewritten_history_starts_a_fresh_session(manager: FleetServerManager, fleet: FleetClient) -> None:
    first = fields(await manager.generate("r", prompt_ids=prompt("hello"), sampling_params=VERL_PARAMS))
    old = first["extra_fields"]["fleet_session_id"]
    again = fields(await manager.generate("r", prompt_ids=prompt("hello"), sampling_params=VERL_PARAMS))
    assert again["extra_fields"]["fleet_session_id"] != old and again["token_ids"] == first["token_ids"]
    assert (await fleet.status(old)).closed


async def test_bad_input_is_refused_and_leaves_no_session(manager: FleetServerManager, fleet: FleetClient) -> None:
    with pytest.raises(ValueError, match="multimodal"):
        await manager.generate("r", prompt_ids=prompt("hi"), sampling_params=VERL_PARAMS, image_data=[object()])
    with pytest.raises(ValueError, match="'n'"):
        await manager.generate("r", prompt_ids=prompt("hi"), sampling_params={"n": 2})
    assert manager.open_requests == []
    with pytest.raises(VerlFleetError, match="invalid_request") as info:
        await manager.generate("r", prompt_ids=prompt("hi"), sampling_params={"top_p": 3.0})
    assert info.value.code == "invalid_request" and manager.open_requests == []
    with pytest.raises(VerlFleetError, match="invalid_request"):
        await manager.generate("r", prompt_ids=[10_000], sampling_params=VERL_PARAMS)
    assert manager.open_requests == []


async def test_a_refused_turn_keeps_the_conversation(manager: FleetServerManager, fleet: FleetClient) -> None:
    first_prompt = prompt("2 + 2?")
    first = fields(await manager.generate("r", prompt_ids=first_prompt, sampling_params=VERL_PARAMS))
    session_id = first["extra_fields"]["fleet_session_id"]
    longer = [*first_prompt, *first["token_ids"], *TOK.encode("<|user|>more<|eos|><|assistant|>")]
    with pytest.raises(VerlFleetError, match="invalid_request"):
        await manager.generate("r", prompt_ids=[*longer, 10_000], sampling_params=VERL_PARAMS)
    status = await fleet.status(session_id)
    assert (status.closed, status.committed_step_id) == (False, 0) and manager.open_requests == ["r"]
    retry = fields(await manager.generate("r", prompt_ids=longer, sampling_params=VERL_PARAMS))
    assert retry["extra_fields"]["fleet_session_id"] == session_id
    assert (await fleet.status(session_id)).context_length == len(longer) + len(retry["token_ids"])
