"""The reference language model through ReferenceEngine: real torch, bitwise comparisons."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from schemas.errors import InvalidRequestError
from schemas.messages import Observation, SamplingParams, TokenStep, WorldStep
from schemas.reference_tokenizer import EOS_ID, ReferenceTokenizer
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.reference import LM_MODEL, ReferenceEngine, ReferenceEngineConfig
from workers.engines.reference_lm import ReferenceLanguageModel, ReferenceLMConfig

tok = ReferenceTokenizer()


def prompt(text: str) -> tuple[int, ...]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert isinstance(ids, list)
    return tuple(ids)


def user_turn(text: str) -> tuple[int, ...]:
    return (tok.convert_tokens_to_ids("<|user|>"), *tok.encode(text), EOS_ID, tok.convert_tokens_to_ids(
        "<|assistant|>"))


def tstep(ids: tuple[int, ...], *, routed: bool = False, **sampling: Any) -> TokenStep:
    return TokenStep(token_ids=ids, sampling=SamplingParams(**sampling), return_routed_experts=routed)


def req(key: str, s: Any, **kwargs: Any) -> EngineRequest:
    return EngineRequest(session_key=key, model=LM_MODEL, step=s, **kwargs)


def ok(result: EngineOutput | BaseException) -> EngineOutput:
    assert isinstance(result, EngineOutput), result
    return result


def run(engine: ReferenceEngine, *requests: EngineRequest) -> list[EngineOutput]:
    return [ok(r) for r in engine.run_direct(LM_MODEL, list(requests))]


def same(a: EngineOutput, b: EngineOutput) -> bool:
    """Bitwise equality of two LM outputs (tokens, logprob bits, routed experts, context)."""
    routed_a, routed_b = a.output.get("routed_experts"), b.output.get("routed_experts")
    routed_same = (routed_a is None and routed_b is None) or (
        routed_a is not None and routed_b is not None and routed_a.tobytes() == routed_b.tobytes()
        and routed_a.shape == routed_b.shape)
    return (a.output["token_ids"] == b.output["token_ids"] and routed_same
            and np.array(a.output["logprobs"]).tobytes() == np.array(b.output["logprobs"]).tobytes()
            and a.output["finish_reason"] == b.output["finish_reason"] and a.context_length == b.context_length)


@pytest.fixture
def engine() -> ReferenceEngine:
    return ReferenceEngine()


def test_output_shape(engine: ReferenceEngine) -> None:
    p = prompt("hello")
    out = run(engine, req("a", tstep(p, max_tokens=8, seed=1)))[0]
    assert set(out.output) == {"token_ids", "logprobs", "finish_reason"}
    ids, logprobs = out.output["token_ids"], out.output["logprobs"]
    assert len(ids) == len(logprobs) == 8 and out.output["finish_reason"] == "length"
    assert all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in ids)
    assert all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in logprobs)
    assert out.context_length == len(p) + 8


def test_deterministic_across_sessions_and_engines(engine: ReferenceEngine) -> None:
    a = run(engine, req("a", tstep(prompt("x"), max_tokens=12, seed=3)))[0]
    b = run(engine, req("b", tstep(prompt("x"), max_tokens=12, seed=3)))[0]
    c = run(ReferenceEngine(), req("c", tstep(prompt("x"), max_tokens=12, seed=3)))[0]
    assert same(a, b) and same(a, c)
    d = run(ReferenceEngine(ReferenceEngineConfig(seed=9)), req("c", tstep(prompt("x"), max_tokens=12, seed=3)))[0]
    assert d.output["token_ids"] != a.output["token_ids"]


def test_seeds_and_greedy(engine: ReferenceEngine) -> None:
    p = prompt("seeds")
    s1, s1b, s2, default, default0 = run(
        engine, req("a", tstep(p, max_tokens=16, seed=1)), req("b", tstep(p, max_tokens=16, seed=1)),
        req("c", tstep(p, max_tokens=16, seed=2)), req("d", tstep(p, max_tokens=16)),
        req("e", tstep(p, max_tokens=16, seed=0)))
    assert same(s1, s1b) and same(default, default0)
    assert s1.output["token_ids"] != s2.output["token_ids"]
    greedy = run(engine, *(req(f"g{i}", tstep(p, max_tokens=16, temperature=0.0, seed=i)) for i in range(3)))
    assert same(greedy[0], greedy[1]) and same(greedy[0], greedy[2])
    # top_k=1 and top_p=0 both reduce sampling to greedy
    top_k1, top_p0 = run(engine, req("k", tstep(p, max_tokens=16, top_k=1, seed=5)),
                         req("p", tstep(p, max_tokens=16, top_p=0.0, seed=6)))
    assert top_k1.output["token_ids"] == top_p0.output["token_ids"] == greedy[0].output["token_ids"]
    filtered = run(engine, req("f", tstep(p, max_tokens=16, top_k=5, top_p=0.9, seed=1)))[0]
    assert len(filtered.output["token_ids"]) == 16


def test_stop_tokens_and_eos(engine: ReferenceEngine) -> None:
    p = prompt("stop")
    full = run(engine, req("a", tstep(p, max_tokens=16, temperature=0.0)))[0].output["token_ids"]
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    out = run(engine, req("b", tstep(p, max_tokens=16, temperature=0.0, stop_token_ids=(stop, 999))))[0]
    assert out.output["token_ids"] == cut and out.output["finish_reason"] == "stop"
    assert out.context_length == len(p) + len(cut)
    eos_engine = ReferenceEngine(ReferenceEngineConfig(lm=ReferenceLMConfig(eos_token_id=stop)))
    eos_out = run(eos_engine, req("c", tstep(p, max_tokens=16, temperature=0.0)))[0]
    assert eos_out.output["token_ids"] == cut and eos_out.output["finish_reason"] == "stop"


def test_max_tokens(engine: ReferenceEngine) -> None:
    p = prompt("max")
    out = run(engine, req("a", tstep(p, max_tokens=3, seed=1)))[0]
    assert len(out.output["token_ids"]) == 3 and out.output["finish_reason"] == "length"
    zero = run(engine, req("b", tstep(p, max_tokens=0, routed=True)))[0]
    assert zero.output["token_ids"] == [] and zero.output["logprobs"] == []
    assert zero.output["finish_reason"] == "length" and zero.context_length == len(p)
    assert zero.output["routed_experts"].shape == (len(p) - 1, 2, 2)
    # the session continues from the prompt alone: same as one step with max_tokens=3
    more = run(engine, req("b", tstep((), max_tokens=3, seed=1)))[0]
    assert more.output["token_ids"] == out.output["token_ids"]


def test_kv_cache_persists_across_turns(engine: ReferenceEngine) -> None:
    p1, p2 = prompt("turn one"), user_turn("turn two")
    first = run(engine, req("a", tstep(p1, max_tokens=6, temperature=0.0)))[0]
    second = run(engine, req("a", tstep(p2, max_tokens=6, temperature=0.0)))[0]
    assert first.context_length == len(p1) + 6
    assert second.context_length == first.context_length + len(p2) + 6
    # one-shot prefill of the whole conversation agrees (up to float rounding of chunked prefill)
    history = (*p1, *first.output["token_ids"], *p2)
    one_shot = run(engine, req("b", tstep(history, max_tokens=6, temperature=0.0)))[0]
    assert one_shot.output["token_ids"] == second.output["token_ids"]
    np.testing.assert_allclose(one_shot.output["logprobs"], second.output["logprobs"], rtol=1e-4, atol=1e-4)
    # without the cached context the second turn comes out differently
    engine.drop_session("a")
    dropped = run(engine, req("a", tstep(p2, max_tokens=6, temperature=0.0)))[0]
    assert dropped.output["token_ids"] != second.output["token_ids"]
    assert dropped.context_length == len(p2) + 6


def test_routed_experts_over_two_turns(engine: ReferenceEngine) -> None:
    p1, p2 = prompt("experts"), user_turn("again")
    first = run(engine, req("a", tstep(p1, max_tokens=5, seed=1, routed=True)))[0]
    second = run(engine, req("a", tstep(p2, max_tokens=7, seed=1, routed=True)))[0]
    r1, r2 = first.output["routed_experts"], second.output["routed_experts"]
    assert r1.dtype == np.int16 and r1.shape == (len(p1) + 5 - 1, 2, 2)
    assert r2.shape == (len(p2) + 7, 2, 2)  # includes turn one's last token, fed now
    assert r1.shape[0] + r2.shape[0] == second.context_length - 1
    assert ((r1 >= 0) & (r1 < 4)).all() and (r1[:, :, 0] != r1[:, :, 1]).all()
    assert "routed_experts" not in run(engine, req("b", tstep(p1, max_tokens=2)))[0].output


def test_batch_invariance(engine: ReferenceEngine) -> None:
    alone = ReferenceEngine()
    target = [tstep(prompt("target"), max_tokens=9, seed=4, routed=True),
              tstep(user_turn("more"), max_tokens=16, seed=5, top_k=40, top_p=0.95, routed=True)]
    expected = [run(alone, req("t", s))[0] for s in target]
    others = [
        [req("x", tstep(prompt("a much longer prompt " * 5), max_tokens=16, seed=1)),
         req("y", tstep(prompt("g"), max_tokens=2, temperature=0.0, routed=True)),
         req("z", tstep(prompt("zz"), max_tokens=0))],
        [req("x", tstep(user_turn("x2"), max_tokens=3, seed=2)),
         req("y", tstep(user_turn("y2"), max_tokens=16, temperature=0.5, routed=True)),
         req("w", tstep(prompt("new session"), max_tokens=12, seed=8))],
    ]
    for turn, s in enumerate(target):
        batch = [*others[turn][:2], req("t", s), *others[turn][2:], req(f"v{turn}", tstep(prompt("v"), max_tokens=5))]
        got = run(engine, *batch)
        assert same(got[2], expected[turn]), turn


def test_reset_and_stateless(engine: ReferenceEngine) -> None:
    p1, p2, p3 = prompt("reset me"), user_turn("next"), user_turn("third")
    fresh = run(ReferenceEngine(), req("f", tstep(p1, max_tokens=5, seed=1)),
                req("g", tstep(p2, max_tokens=5, seed=1)))
    first = run(engine, req("a", tstep(p1, max_tokens=5, seed=1)))[0]
    assert same(first, fresh[0])
    run(engine, req("a", tstep(p2, max_tokens=5, seed=1)))
    reset = run(engine, req("a", tstep(p1, max_tokens=5, seed=1), reset=True))[0]
    assert same(reset, fresh[0])
    twin = ReferenceEngine()
    run(twin, req("a", tstep(p1, max_tokens=5, seed=1)))
    stateless = run(engine, req("a", tstep(p2, max_tokens=5, seed=1), stateless=True))[0]
    assert same(stateless, fresh[1])
    # the stateless step did not touch session "a": its next step matches a twin that never ran it
    after, twin_after = (run(e, req("a", tstep(p3, max_tokens=5, seed=2, routed=True)))[0] for e in (engine, twin))
    assert same(after, twin_after)
    run(engine, req("s", tstep(p1, max_tokens=1), stateless=True))
    assert "s" not in engine.session_keys()


def test_context_limit() -> None:
    engine = ReferenceEngine(ReferenceEngineConfig(lm=ReferenceLMConfig(max_context=64)))
    twin = ReferenceEngine(ReferenceEngineConfig(lm=ReferenceLMConfig(max_context=64)))
    for e in (engine, twin):
        assert run(e, req("a", tstep(tuple(range(40)), max_tokens=10, seed=1)))[0].context_length == 50
    too_long = engine.run_direct(LM_MODEL, [req("a", tstep(tuple(range(15)), max_tokens=1))])[0]
    assert isinstance(too_long, InvalidRequestError) and "max_context" in str(too_long)
    clamped, twin_clamped = (run(e, req("a", tstep(tuple(range(10)), max_tokens=16, seed=2)))[0]
                             for e in (engine, twin))
    assert same(clamped, twin_clamped)  # the failed request left the session unchanged
    assert len(clamped.output["token_ids"]) == 4 and clamped.output["finish_reason"] == "length"
    assert clamped.context_length == 64
    full = run(engine, req("a", tstep((), max_tokens=5)))[0]
    assert full.output["token_ids"] == [] and full.output["finish_reason"] == "length"


def test_invalid_requests_fail_alone(engine: ReferenceEngine) -> None:
    expected = run(ReferenceEngine(), req("ok", tstep(prompt("fine"), max_tokens=4, seed=1)))[0]
    run(engine, req("bad", tstep(prompt("history"), max_tokens=2)))
    results = engine.run_direct(LM_MODEL, [
        req("bad", tstep((1, 99999), max_tokens=2)),
        req("ok", tstep(prompt("fine"), max_tokens=4, seed=1)),
        req("empty", tstep((), max_tokens=2)),
        req("world", WorldStep(Observation())),
        req("mm", TokenStep(token_ids=(1,), multimodal={"image": b"x"})),
        req("seed", tstep((1,), max_tokens=1, seed=1 << 64)),
    ])
    assert same(ok(results[1]), expected)
    for index in (0, 2, 3, 4, 5):
        assert isinstance(results[index], InvalidRequestError), results[index]
    assert run(engine, req("bad", tstep((), max_tokens=0)))[0].context_length == len(prompt("history")) + 2
    assert set(engine.session_keys()) == {"bad", "ok"}


async def test_run_batch_async(engine: ReferenceEngine) -> None:
    await engine.start()
    results = await engine.run_batch(LM_MODEL, [req("a", tstep(prompt("async"), max_tokens=4, seed=1))])
    direct = run(ReferenceEngine(), req("a", tstep(prompt("async"), max_tokens=4, seed=1)))[0]
    assert same(ok(results[0]), direct)
    assert engine.models()[LM_MODEL].value == "tokens"
    await engine.close()


def test_model_api_directly() -> None:
    model = ReferenceLanguageModel(ReferenceLMConfig(num_layers=1, num_experts=2, top_k=1), seed=0)
    (result,) = model.generate([(None, tstep(prompt("direct"), max_tokens=3, seed=1, routed=True))])
    assert len(result.token_ids) == 3 and result.routed_experts is not None
    assert result.routed_experts.shape == (len(prompt("direct")) + 2, 1, 1)
    assert result.state.fed == result.context_length - 1
    with pytest.raises(InvalidRequestError):
        model.generate([(None, tstep((300,), max_tokens=1))])


def test_drop_session_never_waits_for_a_running_batch(engine: ReferenceEngine) -> None:
    """The worker calls drop_session on its event loop: waiting for a batch would stall heartbeats
    and reads for as long as the batch runs. The drop applies before the next batch instead."""
    import threading

    first = ok(engine.run_direct(LM_MODEL, [req("a", tstep(prompt("hi"), max_tokens=3, seed=1), reset=True)])[0])
    assert "a" in engine.session_keys()
    with engine._lock:  # a batch holds the engine
        dropper = threading.Thread(target=engine.drop_session, args=("a",))
        dropper.start()
        dropper.join(timeout=10)
        assert not dropper.is_alive()
    again = ok(engine.run_direct(LM_MODEL, [req("a", tstep(prompt("hi"), max_tokens=3, seed=1))])[0])
    assert again.context_length == first.context_length  # started fresh: the drop was applied
    assert again.output["token_ids"] == first.output["token_ids"]
