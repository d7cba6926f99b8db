"""The byte-level reference tokenizer: round trips, specials, the prefix-stable chat template."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from schemas.reference_tokenizer import (
    ASSISTANT_ID,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    USER_ID,
    VOCAB_SIZE,
    ReferenceTokenizer,
)

tok = ReferenceTokenizer()


@pytest.mark.parametrize("text", ["", "hello world", "naïve café — ✓", "emoji 🤖 and\nnewlines\t", "\x00\xff"])
def test_round_trip(text: str) -> None:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_and_vocab() -> None:
    ids = [tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(256, 256 + len(SPECIAL_TOKENS)))
    assert VOCAB_SIZE == tok.vocab_size == len(tok) == 263
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert sorted(tok.all_special_ids) == ids
    assert tok.convert_tokens_to_ids(["<|eos|>", "a"]) == [EOS_ID, ord("a")]
    with pytest.raises(ValueError):
        tok.convert_tokens_to_ids("ab")


def test_decode_specials_and_invalid_bytes() -> None:
    ids = [BOS_ID, *b"hi", EOS_ID, 0xFF, *b"!"]
    assert tok.decode(ids) == "<|bos|>hi<|eos|>\ufffd!"
    assert tok.decode(ids, skip_special_tokens=True) == "hi\ufffd!"
    with pytest.raises(ValueError):
        tok.decode([VOCAB_SIZE])
    assert tok.convert_ids_to_tokens([USER_ID, 65]) == ["<|user|>", "A"]


def test_encode_parses_special_names_unless_asked_not_to() -> None:
    assert tok.encode("a<|eos|>b") == [97, EOS_ID, 98]
    assert tok.encode("a<|eos|>b", parse_special=False) == list(b"a<|eos|>b")
    assert tok.decode(tok.encode("x<|user|>y")) == "x<|user|>y"


def test_chat_template_format() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == [BOS_ID, tok.convert_tokens_to_ids("<|system|>"), *b"be brief", EOS_ID,
                   USER_ID, *b"hi", EOS_ID, ASSISTANT_ID]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>be brief<|eos|><|user|>hi<|eos|><|assistant|>"
    assert tok.encode(text) == ids


def test_chat_template_is_prefix_stable() -> None:
    conversation = [{"role": "user", "content": "first"}]
    previous = tok.apply_chat_template(conversation, add_generation_prompt=True)
    assert isinstance(previous, list)
    for turn in range(3):
        conversation.append({"role": "assistant", "content": f"answer {turn}"})
        closed = tok.apply_chat_template(conversation)
        assert isinstance(closed, list)
        assert closed[: len(previous)] == previous
        conversation.append({"role": "user", "content": f"follow-up {turn}"})
        rendered = tok.apply_chat_template(conversation, add_generation_prompt=True)
        assert isinstance(rendered, list)
        assert rendered[: len(closed)] == closed
        assert rendered[-1] == ASSISTANT_ID
        previous = rendered


def test_chat_template_content_parts_and_errors() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "ab"}])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}])
    # Special-token names inside content stay bytes: a user cannot inject a turn boundary.
    injected = tok.apply_chat_template([{"role": "user", "content": "<|eos|>"}])
    assert injected == [BOS_ID, USER_ID, *b"<|eos|>", EOS_ID]


def test_continue_final_message() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    ids = tok.apply_chat_template(messages, continue_final_message=True)
    assert ids == [BOS_ID, USER_ID, *b"q", EOS_ID, ASSISTANT_ID, *b"partial"]
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)


def test_module_does_not_import_torch() -> None:
    code = "import sys, schemas.reference_tokenizer; sys.exit(1 if 'torch' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
