"""Input row -> prompt text and token ids."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .errors import RowError
from .inputs import InputRow
from .jobspec import InputSpec
from .tokenizer import Tokenizer


@dataclass
class Prompt:
    """A built prompt.

    Attributes:
        text: the user text recorded in the output ``prompt`` column (the last user turn for conversations).
        token_ids: the model's input ids (chat template applied, BOS as the model wants it).
    """

    text: str | None
    token_ids: list[int]


# Message roles accepted (OpenAI's chat roles; "developer" is its newer name for "system").
ROLES = ("system", "user", "assistant", "tool", "developer")


def _check_messages(messages) -> list[dict]:
    """Copies of the messages without None-valued keys (Arrow gives every struct field to every message,
    None where a source message lacked it); other keys (``name``, ``tool_calls``, ...) pass through.

    Raises:
        RowError: no messages, a message without string ``role`` and ``content``, or a role not in
            ``ROLES`` (system, user, assistant, tool, developer).
    """
    if not messages:
        raise RowError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"messages[{i}] needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise RowError(f"messages[{i}]: unknown role {m['role']!r} (expected {', '.join(ROLES[:-1])} or {ROLES[-1]})")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


@lru_cache(maxsize=8)
def _special_regex(specials: tuple[str, ...]) -> re.Pattern | None:
    # special_tokens lists the longest first, so the alternation takes the longest token at each position
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def _free_chars(texts: list[str]) -> tuple[str, str]:
    """Two private-use characters that occur in none of ``texts``."""
    used = set().union(*map(set, texts))
    free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
    try:
        return next(free), next(free)
    except StopIteration:
        raise RowError("the row uses every private-use character; cannot mark special-token text") from None


def _encode_template(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Render ``messages`` and encode them so that only the template's own markup becomes special tokens.

    Special-token text inside the messages' string values (content, role, name, ...; not nested ones
    such as ``tool_calls``) is swapped for private-use placeholders before rendering; the rendered text
    is split at the placeholders, template pieces are encoded with special tokens parsed and each
    placeholder's original text without. Rows with no special-token text are one piece, encoded as one
    string.
    """
    pattern = _special_regex(tokenizer.special_tokens)
    strings = [v for m in messages for v in m.values() if isinstance(v, str)]
    if pattern is None or not any(pattern.search(v) for v in strings):
        return tokenizer.encode(_render(tokenizer, messages), parse_special=True)
    open_, close = _free_chars([tokenizer.chat_template, *strings])
    originals: list[str] = []

    def mark(match: re.Match) -> str:
        originals.append(match.group())
        return f"{open_}{len(originals) - 1}{close}"

    marked = [{k: pattern.sub(mark, v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
    pieces = re.split(f"{open_}([0-9]+){close}", _render(tokenizer, marked))
    if any(open_ in p or close in p for p in pieces[::2]):
        raise RowError("the chat template cut up special-token text in the messages "
                       "(set input.parse_special_tokens: true to encode the rendered text as it is)")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += tokenizer.encode(originals[int(piece)], parse_special=False)
        elif piece:
            ids += tokenizer.encode(piece, parse_special=True)
    return ids


def _render(tokenizer: Tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise RowError(str(e)) from None


def _with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    if tokenizer.add_bos_token and tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        return [tokenizer.bos_token_id, *ids]
    return ids


def build_prompt(row: InputRow, spec: InputSpec, tokenizer: Tokenizer) -> Prompt:
    """Build the model input for ``row``.

    Rows with non-null ``messages`` use them; otherwise the ``prompt`` text, wrapped as one user turn
    when ``spec.apply_chat_template``. ``spec.system_prompt`` is prepended to conversations that have no
    system turn. With ``spec.parse_special_tokens`` false (the default), special-token text inside the
    prompt, the messages or the system prompt is encoded as plain text and only the template's own markup
    becomes special tokens; true encodes the rendered template (or the raw prompt) with special tokens
    parsed, as HF transformers does. BOS is added only if the model asks for it and it is not already
    there.

    Raises:
        RowError: null or empty prompt, malformed messages (empty, a message without string role and
            content, a role other than system, user, assistant, tool or developer), a template that rejects
            them or that cuts up special-token text of the messages.
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
            return Prompt(text, _with_bos(tokenizer, tokenizer.encode(text, parse_special=spec.parse_special_tokens)))
        messages = [{"role": "user", "content": text}]
    if spec.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    if spec.parse_special_tokens:
        ids = tokenizer.encode(_render(tokenizer, messages), parse_special=True)
    else:
        ids = _encode_template(tokenizer, messages)
    return Prompt(text, _with_bos(tokenizer, ids))
