"""Where vime's generate function takes its tokenizer and model from, and the length checks on the
filled Sample. The HF tokenizer is a tiny WordLevel one saved into tmp_path (no hub downloads)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from broker.integrations import vime
from broker.integrations.vime_sample import SampleLengthError, check_sample
from schemas.reference_tokenizer import ReferenceTokenizer
from tests.test_vime_adapter import Sample

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _save_tokenizer(path: Path) -> Path:
    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return path


def _args(**kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(rollout_interaction_env_path="tests.test_vime_adapter", max_turns=1,
                           partial_rollout=False, **kwargs)


def test_tokenizer_loads_from_the_checkpoint_directory(tmp_path: Path) -> None:
    checkpoint = _save_tokenizer(tmp_path / "policy")
    args = _args(hf_checkpoint=str(checkpoint))
    model = vime.model_name(args)
    assert model == str(checkpoint)  # vime names its router's model by the checkpoint too
    tok = vime.tokenizer_for(args, model)
    assert not isinstance(tok, ReferenceTokenizer)
    assert tok.encode("hello world", add_special_tokens=False) == [2, 3]
    assert tok.eos_token_id == 1
    assert vime.tokenizer_for(args, "served-name") is tok  # loaded once per checkpoint
    assert vime.model_name(_args(hf_checkpoint=str(checkpoint), fleet_model="served-name")) == "served-name"


def test_reference_tokenizer_only_for_the_reference_model(tmp_path: Path) -> None:
    assert isinstance(vime.tokenizer_for(_args(), "reference-lm"), ReferenceTokenizer)
    with pytest.raises(ValueError, match="no tokenizer for model 'policy'"):
        vime.tokenizer_for(_args(fleet_model="policy"), "policy")
    with pytest.raises(ValueError, match="no model to roll out"):
        vime.model_name(_args())
    with pytest.raises(ValueError, match="cannot load a tokenizer"):  # local files only: no hub lookup
        vime.tokenizer_for(_args(hf_checkpoint=str(tmp_path / "missing")), "policy")


async def test_generate_refuses_without_a_model_or_tokenizer() -> None:
    sample = Sample(prompt="2 + 2?")
    # No fleet is reachable at this URL: the refusal comes before any connection or state change.
    args = _args(fleet_redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="no model to roll out"):
        await vime.generate(args, sample, {"max_new_tokens": 4})
    args.fleet_model = "policy"
    with pytest.raises(ValueError, match="no tokenizer for model 'policy'"):
        await vime.generate(args, sample, {"max_new_tokens": 4})
    assert sample.status is Sample.Status.PENDING and sample.tokens == [] and sample.response_length == 0


def _filled(**changes: Any) -> Sample:
    sample = Sample(tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.1, -0.2],
                    status=Sample.Status.COMPLETED, weight_versions=["3"])
    for name, value in changes.items():
        setattr(sample, name, value)
    return sample


def test_check_sample_accepts_agreeing_fields() -> None:
    sample = _filled(rollout_routed_experts=np.zeros((3, 2, 2), dtype=np.int32), multimodal_train_inputs={})
    assert check_sample(sample) is sample


@pytest.mark.parametrize(("changes", "match"), [
    ({"loss_mask": [1]}, "loss_mask has 1 entries for a response of 2"),
    ({"rollout_log_probs": [-0.1, -0.2, -0.3]}, "rollout_log_probs has 3 entries"),
    ({"rollout_log_probs": None}, "rollout_log_probs has no length"),
    ({"response_length": 5}, "response_length=5 is not within the 4 tokens"),
    ({"loss_mask": [1, 2]}, "other than 0 and 1"),
    ({"status": Sample.Status.PENDING}, "not a finished status"),
    ({"weight_versions": [3]}, "weight_versions"),
    ({"rollout_routed_experts": np.zeros((4, 2, 2))}, r"rollout_routed_experts is \(4, 2, 2\)"),
    ({"multimodal_train_inputs": [1]}, "multimodal_train_inputs must be a dict"),
])
def test_check_sample_names_the_disagreeing_field(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(SampleLengthError, match=match):
        check_sample(_filled(**changes))
