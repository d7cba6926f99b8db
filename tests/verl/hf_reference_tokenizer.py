"""The reference LM's byte-level vocabulary as a real Hugging Face tokenizer (built with the
``tokenizers`` library, no download): verl's agent loops take an HF tokenizer object."""

from __future__ import annotations

from typing import Any

from schemas.reference_tokenizer import SPECIAL_IDS, SPECIAL_TOKENS

# Tool results go back as user turns: the reference vocabulary has no tool role.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|>{% else %}<|{{ m['role'] }}|>{% endif %}"
    "{{ m['content'] }}<|eos|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def hf_reference_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose ids are the reference tokenizer's (bytes 0..255, then
    its special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    model = models.BPE(vocab=vocab, merges=[])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # in order: ids 256.. as the reference tokenizer's
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
                                 additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in
                                                            ("<|pad|>", "<|bos|>", "<|eos|>")])
    hf.chat_template = CHAT_TEMPLATE
    ids = hf.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != [SPECIAL_IDS[t] for t in SPECIAL_TOKENS]:
        raise AssertionError(f"special token ids {ids} differ from the reference tokenizer's")
    return hf
