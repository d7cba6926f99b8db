"""Stop strings, top-k log probs, presence/frequency/repetition penalties and min_tokens: the wire
schema's checks, the penalty arithmetic against hand-computed logits, and their effect on the
reference LM's outputs (deterministic, batch invariant)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from schemas.errors import InvalidRequestError
from schemas.messages import SamplingParams
from schemas.reference_tokenizer import EOS_ID, ReferenceTokenizer
from tests.test_reference_lm import ok, prompt, req, run, same, tstep
from workers.engines.reference import LM_MODEL, ReferenceEngine
from workers.engines.reference_sampling import process_logits, stop_string_hit, top_logprobs
from workers.engines.token_sessions import sampling_fields

tok = ReferenceTokenizer()


@pytest.fixture
def engine() -> ReferenceEngine:
    return ReferenceEngine()


def test_wire_round_trip_and_defaults_unchanged() -> None:
    assert set(SamplingParams().to_wire()) == {"max_tokens", "temperature", "top_p", "top_k", "seed",
                                               "stop_token_ids"}
    params = SamplingParams.from_wire({"stop": "ab", "logprobs": 3, "presence_penalty": 0.5,
                                       "frequency_penalty": -1.0, "repetition_penalty": 1.3, "min_tokens": 2})
    assert params.stop == ("ab",) and params.logprobs == 3 and params.min_tokens == 2
    assert SamplingParams.from_wire(params.to_wire()) == params
    fields = sampling_fields(params, 0)
    assert fields["stop"] == ["ab"] and fields["logprobs"] == 3 and fields["repetition_penalty"] == 1.3
    assert fields["presence_penalty"] == 0.5 and fields["frequency_penalty"] == -1.0 and fields["min_tokens"] == 2


@pytest.mark.parametrize(("wire", "match"), [
    ({"stop": [""]}, "sampling.stop must hold non-empty strings"),
    ({"stop": [3]}, "sampling.stop must hold non-empty strings"),
    ({"stop": ["x"] * 17}, "17 strings; limit is 16"),
    ({"logprobs": 21}, "sampling.logprobs"),
    ({"logprobs": -1}, "sampling.logprobs"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty must be within"),
    ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty must be a finite number"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be within"),
    ({"min_tokens": -1}, "sampling.min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) exceeds max_tokens \(4\)"),
])
def test_bad_sampling_is_refused(wire: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams.from_wire(wire)


def test_penalty_math_against_hand_computed_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # context = prompt (4) + output (2, 2, 0); repetition over the context, the others over the output
    out = process_logits(logits, params, context=[4, 2, 2, 0], generated=[2, 2, 0], stops={EOS_ID})
    # token 0: 2.0 / 2 - 0.5 * 1 - 0.25 = 0.25; token 2: 0.5 / 2 - 0.5 * 2 - 0.25 = -1.0
    # token 4: -2.0 * 2 = -4.0 (only in the prompt); tokens 1 and 3 untouched
    assert out.tolist() == [0.25, -1.0, -1.0, 3.0, -4.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the caller's row is not changed
    masked = process_logits(logits, SamplingParams(min_tokens=2), context=[1], generated=[1], stops={3, 4})
    assert masked.tolist() == [2.0, -1.0, 0.5, -torch.inf, -torch.inf]
    assert process_logits(logits, SamplingParams(min_tokens=1), [1], [1], {3}) is logits  # nothing applies


def test_penalties_change_the_output_deterministically(engine: ReferenceEngine) -> None:
    p = prompt("penalties")
    base = run(engine, req("a", tstep(p, max_tokens=24, temperature=0.0)))[0].output["token_ids"]
    for penalty in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        first = run(engine, req("b", tstep(p, max_tokens=24, temperature=0.0, **penalty)))[0]
        again = run(ReferenceEngine(), req("c", tstep(p, max_tokens=24, temperature=0.0, **penalty)))[0]
        assert first.output["token_ids"] != base, penalty
        assert same(first, again), penalty
        engine.drop_session("b")


def test_min_tokens_suppresses_eos(engine: ReferenceEngine) -> None:
    p = prompt("stop")
    full = run(engine, req("a", tstep(p, max_tokens=16, temperature=0.0)))[0].output["token_ids"]
    stop = full[2]
    early = run(engine, req("b", tstep(p, max_tokens=16, temperature=0.0, stop_token_ids=(stop,))))[0]
    assert early.output["token_ids"] == full[: full.index(stop) + 1]
    held = run(engine, req("c", tstep(p, max_tokens=16, temperature=0.0, stop_token_ids=(stop,),
                                      min_tokens=8)))[0].output
    assert stop not in held["token_ids"][:8] and len(held["token_ids"]) >= 8
    if stop in held["token_ids"]:
        assert held["finish_reason"] == "stop" and held["token_ids"][-1] == stop


def test_stop_string_across_two_tokens_stops_and_is_reported(engine: ReferenceEngine) -> None:
    p = prompt("stop string")
    full = run(engine, req("a", tstep(p, max_tokens=16, temperature=0.0)))[0].output["token_ids"]
    pair = next(i for i in range(3, len(full) - 1)
                if all(t < 128 and chr(t).isprintable() for t in full[i : i + 2]))
    text = tok.decode(full[pair : pair + 2])  # two ASCII byte tokens, two characters
    first = tok.decode(full).find(text)
    out = run(engine, req("b", tstep(p, max_tokens=16, temperature=0.0, stop=(text, "never seen"))))[0].output
    assert out["finish_reason"] == "stop" and out["stop_reason"] == text
    assert tok.decode(out["token_ids"]).endswith(text) and len(tok.decode(out["token_ids"])) == first + 2
    assert out["token_ids"] == full[: len(out["token_ids"])]  # the same tokens, cut where the string ends
    assert stop_string_hit(list(tok.encode("xab")), ["ab"]) == "ab"
    assert stop_string_hit(list(tok.encode("abx")), ["ab"]) is None  # completed earlier: not by this token


def test_top_logprobs_per_token(engine: ReferenceEngine) -> None:
    p = prompt("top")
    plain = run(engine, req("a", tstep(p, max_tokens=6, seed=3)))[0]
    assert "top_logprobs" not in plain.output
    out = run(engine, req("b", tstep(p, max_tokens=6, seed=3, logprobs=4)))[0].output
    assert out["token_ids"] == plain.output["token_ids"] and out["logprobs"] == plain.output["logprobs"]
    assert len(out["top_logprobs"]) == 6
    for token, logprob, top in zip(out["token_ids"], out["logprobs"], out["top_logprobs"], strict=True):
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert logprob <= top[-1][1] or token in [t for t, _ in top]
    assert top_logprobs(torch.tensor([0.0, -1.0, 0.0]), 2) == [[0, 0.0], [2, 0.0]]  # ties: lower id first


def test_new_params_keep_batch_invariance(engine: ReferenceEngine) -> None:
    target = tstep(prompt("target"), max_tokens=12, seed=4, repetition_penalty=1.5, frequency_penalty=0.3,
                   logprobs=2, min_tokens=3, stop=("zz",))
    alone = ok(ReferenceEngine().run_direct(LM_MODEL, [req("t", target)])[0])
    got = run(engine, req("x", tstep(prompt("other " * 4), max_tokens=9, presence_penalty=1.0)), req("t", target),
              req("y", tstep(prompt("y"), max_tokens=3, temperature=0.0, logprobs=5)))[1]
    assert same(got, alone) and got.output["top_logprobs"] == alone.output["top_logprobs"]
