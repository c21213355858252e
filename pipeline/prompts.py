"""Input row -> prompt text and token ids."""

from __future__ import annotations

from dataclasses import dataclass

from .inputs import InputRow
from .jobspec import InputSpec
from .tokenizer import Tokenizer


class RowError(ValueError):
    """This row cannot be generated (recorded in its ``error`` column; the job goes on)."""


@dataclass
class Prompt:
    """A built prompt.

    Attributes:
        text: the user text recorded in the output ``prompt`` column (the last user turn for conversations).
        token_ids: the model's input ids (chat template applied, BOS as the model wants it).
    """

    text: str | None
    token_ids: list[int]


def _check_messages(messages) -> list[dict]:
    if not messages:
        raise RowError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"messages[{i}] needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def build_prompt(row: InputRow, spec: InputSpec, tokenizer: Tokenizer) -> Prompt:
    """Build the model input for ``row``.

    Rows with non-null ``messages`` use them; otherwise the ``prompt`` text, wrapped as one user turn
    when ``spec.apply_chat_template``. ``spec.system_prompt`` is prepended to conversations that have no
    system turn. Template output is tokenized with special tokens parsed; raw prompts with special
    tokens treated as text. BOS is added only if the model asks for it and it is not already there.

    Raises:
        RowError: null or empty prompt, malformed messages, a template that rejects them.
    """
    if row.messages is not None:
        messages = _check_messages(row.messages)
        users = [m["content"] for m in messages if m["role"] == "user"]
        text = users[-1] if users else None
    else:
        if row.prompt is None:
            raise RowError("prompt is null")
        if row.prompt == "":
            raise RowError("prompt is empty")
        text = row.prompt
        if not spec.apply_chat_template:
            return Prompt(text, tokenizer.encode(text, parse_special=False, add_bos=tokenizer.add_bos_token))
        messages = [{"role": "user", "content": text}]
    if spec.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise RowError(str(e)) from None
    return Prompt(text, tokenizer.encode(rendered, parse_special=True, add_bos=tokenizer.add_bos_token))
