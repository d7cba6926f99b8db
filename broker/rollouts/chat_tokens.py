"""Token ids from a chat template for multi-turn rollouts: what the driver needs of a tokenizer,
and the tokens that open each new user turn without re-rendering what the model generated."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

DUMMY_MESSAGES: tuple[Mapping[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)


class ChatTokenizer(Protocol):
    """What the driver needs of a tokenizer (a Hugging Face tokenizer or ReferenceTokenizer)."""

    @property
    def eos_token_id(self) -> Any: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tokenize: bool = ...,
                            add_generation_prompt: bool = ..., tools: Sequence[Any] | None = ...,
                            **kwargs: Any) -> Any: ...

    def encode(self, text: str, /) -> list[int]: ...

    def decode(self, ids: Iterable[int], /, skip_special_tokens: bool = ...) -> str: ...


def observation_token_ids(tokenizer: ChatTokenizer, message: Mapping[str, Any], context: Sequence[int], *,
                          tools: Sequence[Any] | None = None,
                          template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The tokens that open the next user turn and the assistant's reply after ``context``.

    Renders a dummy conversation with and without ``message`` and takes the suffix from the last
    EOS of the dummy prefix (which closes the previous assistant turn); that leading EOS is dropped
    when ``context`` already ends with it. Generated ids are never re-rendered.
    """
    kwargs = dict(template_kwargs or {})
    prefix = template_ids(tokenizer.apply_chat_template(
        list(DUMMY_MESSAGES), tools=tools, tokenize=True, add_generation_prompt=False, **kwargs))
    rendered = template_ids(tokenizer.apply_chat_template(
        [*DUMMY_MESSAGES, message], tools=tools, tokenize=True, add_generation_prompt=True, **kwargs))
    if rendered[: len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix stable")
    eos = eos_id(tokenizer)
    if eos not in prefix:
        raise ValueError(f"the dummy conversation has no eos_token_id={eos}")
    last_eos = len(prefix) - 1 - prefix[::-1].index(eos)
    boundary = prefix[last_eos:] + rendered[len(prefix):]
    return boundary[1:] if context and context[-1] == eos else boundary


def template_ids(value: Any) -> list[int]:
    if isinstance(value, Mapping):
        value = value.get("input_ids")
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise TypeError("apply_chat_template(tokenize=True) must return a list of token ids")
    return list(value)


def eos_id(tokenizer: ChatTokenizer) -> int:
    eos = tokenizer.eos_token_id
    if isinstance(eos, bool) or not isinstance(eos, int):
        raise ValueError("tokenizer.eos_token_id must be an integer")
    return eos


def check_text_message(message: Mapping[str, Any]) -> None:
    content = message.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise ValueError(f"observations must be text (a string or text parts), got {content!r}")


def stop_ids(tokenizer: ChatTokenizer, stop: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for text in stop:
        encoded = tokenizer.encode(text)
        if len(encoded) != 1:
            raise ValueError(f"stop string {text!r} is {len(encoded)} tokens; the fleet stops on single tokens")
        ids.append(encoded[0])
    return ids
