"""Byte-level tokenizer of the reference language model (pure Python, no torch).

Ids 0..255 are raw bytes; the special tokens follow. Trainers import this to build prompts for
``reference-lm`` without installing anything heavy. The chat template is prefix stable: every
message is ``<|role|>`` + text + ``<|eos|>``, so rendering ``[*msgs, new_msg]`` (with or without a
generation prompt) always starts with the rendering of ``msgs``; an RL driver can therefore send
only the new suffix of a conversation to a session that keeps its KV cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

BYTE_TOKENS = 256
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
SPECIAL_IDS: dict[str, int] = {name: BYTE_TOKENS + i for i, name in enumerate(SPECIAL_TOKENS)}
PAD_ID = SPECIAL_IDS["<|pad|>"]
BOS_ID = SPECIAL_IDS["<|bos|>"]
EOS_ID = SPECIAL_IDS["<|eos|>"]
SYSTEM_ID = SPECIAL_IDS["<|system|>"]
USER_ID = SPECIAL_IDS["<|user|>"]
ASSISTANT_ID = SPECIAL_IDS["<|assistant|>"]
END_ID = SPECIAL_IDS["<|end|>"]
VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)  # 263

ROLE_IDS: dict[str, int] = {"system": SYSTEM_ID, "user": USER_ID, "assistant": ASSISTANT_ID}
_SPECIAL_NAMES = {i: name for name, i in SPECIAL_IDS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(name) for name in SPECIAL_TOKENS) + ")")


def _message_text(message: Mapping[str, Any]) -> str:
    """The text of one chat message: a string, None (empty), or a list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("message content parts must be {'type': 'text', 'text': ...}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text part needs a string 'text'")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


class ReferenceTokenizer:
    """HF-tokenizer-like interface over bytes plus seven special tokens."""

    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE
    pad_token: str = "<|pad|>"
    bos_token: str = "<|bos|>"
    eos_token: str = "<|eos|>"

    @property
    def all_special_ids(self) -> list[int]:
        return list(_SPECIAL_NAMES)

    def __len__(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``. Like HF tokenizers, the literal names of special tokens
        (``"<|eos|>"``) become their ids unless ``parse_special=False`` (then: bytes only)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a string, got {type(text).__name__}")
        if not parse_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIAL_IDS:
                ids.append(SPECIAL_IDS[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Bytes decoded as UTF-8 (invalid sequences replaced); specials as their names."""
        out: list[str] = []
        pending = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < BYTE_TOKENS:
                pending.append(i)
                continue
            if i not in _SPECIAL_NAMES:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {VOCAB_SIZE})")
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_NAMES[i])
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    @overload
    def convert_tokens_to_ids(self, token: str) -> int: ...

    @overload
    def convert_tokens_to_ids(self, token: list[str] | tuple[str, ...]) -> list[int]: ...

    def convert_tokens_to_ids(self, token: str | list[str] | tuple[str, ...]) -> int | list[int]:
        """A special token's id, or the id of a single one-byte character."""
        if not isinstance(token, str):
            return [self.convert_tokens_to_ids(t) for t in token]
        if token in SPECIAL_IDS:
            return SPECIAL_IDS[token]
        encoded = token.encode("utf-8")
        if len(encoded) == 1:
            return encoded[0]
        raise ValueError(f"unknown token {token!r}")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Specials as names, bytes as latin-1 characters (one character per id)."""
        return [_SPECIAL_NAMES[i] if i in _SPECIAL_NAMES else bytes([i]).decode("latin-1") for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[int] | str:
        """``<|bos|>`` then ``<|role|>text<|eos|>`` per message, then ``<|assistant|>`` if asked.

        ``continue_final_message=True`` leaves the last message open (no ``<|eos|>``). Tools have
        no format in this model: a non-empty ``tools`` raises ValueError. Other HF keyword
        arguments (``return_tensors`` ...) are not supported and are ignored.
        """
        if tools:
            raise ValueError("the reference chat template has no tool format")
        continue_final = bool(kwargs.get("continue_final_message", False))
        if continue_final and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are exclusive")
        ids: list[int] = [BOS_ID]
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError("each message must be a dict with 'role' and 'content'")
            role = message.get("role")
            if role not in ROLE_IDS:
                raise ValueError(f"unknown role {role!r}; expected one of: {', '.join(ROLE_IDS)}")
            ids.append(ROLE_IDS[role])
            ids.extend(self.encode(_message_text(message), parse_special=False))
            if not (continue_final and index == len(messages) - 1):
                ids.append(EOS_ID)
        if add_generation_prompt:
            ids.append(ASSISTANT_ID)
        return ids if tokenize else self.decode(ids)
