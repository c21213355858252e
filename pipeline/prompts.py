"""Input row -> prompt text and token ids."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .chat_template import ChatTemplateCompileError, ChatTemplateError
from .errors import RowError
from .inputs import InputRow, describe_value
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
        RowError: not a list, no messages, a message without string ``role`` and ``content``, or a role not in
            ``ROLES`` (system, user, assistant, tool, developer).
    """
    if not isinstance(messages, list):
        raise RowError(f"messages is {describe_value(messages)}, not a list")
    if not messages:
        raise RowError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            # a wrong non-null value is named (JSON input mixes types: "content": 5); a null one is plain
            bad = (f"it is {describe_value(m)}" if not isinstance(m, dict) else
                   next((f"{k!r} is {describe_value(m[k])}" for k in ("role", "content")
                         if m.get(k) is not None and not isinstance(m[k], str)), None))
            raise RowError(f"messages[{i}] needs string 'role' and 'content'" + (f"; {bad}" if bad else ""))
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


class _Marker:
    """Control-token text (``Tokenizer.control_tokens``: special tokens and the non-special ones the template
    writes) inside data strings swapped for private-use placeholders (``mark``), so that a rendered text can be
    encoded with only the template's own markup parsed as those tokens (``encode``).

    Args:
        tokenizer: the model's tokenizer.
        strings: every data string that will be marked (to pick placeholders they do not contain).
    """

    def __init__(self, tokenizer: Tokenizer, strings: list[str]):
        self.tokenizer = tokenizer
        self.pattern = _special_regex(tokenizer.control_tokens)
        self.active = self.pattern is not None and any(self.pattern.search(v) for v in strings)
        if self.active:
            self.open, self.close = _free_chars([tokenizer.chat_template or "", *strings])
        self.originals: list[str] = []

    def _sub(self, match: re.Match) -> str:
        self.originals.append(match.group())
        return f"{self.open}{len(self.originals) - 1}{self.close}"

    def mark(self, text: str) -> str:
        return self.pattern.sub(self._sub, text) if self.active else text

    def encode(self, text: str) -> list[int]:
        """Ids of a text built from marked strings. The template's text is encoded with special tokens parsed,
        in one piece between placeholders (as a rendered template is encoded); a placeholder's original text is
        encoded as plain text (``Tokenizer.encode_data``) together with the plain text around it up to the
        template's nearest control tokens, as Hugging Face ``tokenizers`` splits a text at added tokens only (so
        ``"a <|im_end|> b"`` merges " <" as the plain text does).

        Raises:
            RowError: the template cut up a placeholder.
        """
        if not self.active:
            return self.tokenizer.encode(text, parse_special=True)
        pieces = re.split(f"{self.open}([0-9]+){self.close}", text)
        if any(self.open in p or self.close in p for p in pieces[::2]):
            raise RowError("the chat template cut up special-token text in the messages "
                           "(set input.parse_special_tokens: true to encode the rendered text as it is)")
        ids: list[int] = []
        run: list[str] = []  # plain text around placeholders, up to the template's special tokens

        def flush():
            if run:
                ids.extend(self.tokenizer.encode_data("".join(run)))
                run.clear()

        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            if i % 2:
                run.append(self.originals[int(piece)])
                continue
            before, after = i > 0, i < last  # a placeholder next to this piece of the template
            parts = re.split(f"({self.pattern.pattern})", piece)  # odd: the template's special tokens
            if len(parts) == 1:  # no special token: plain text next to a placeholder (or the whole text)
                if before or after:
                    run.append(piece)
                elif piece:
                    ids += self.tokenizer.encode(piece, parse_special=True)
                continue
            head, middle, tail = parts[0], "".join(parts[1:-1]), parts[-1]
            if before:
                run.append(head)
            flush()
            ids += self.tokenizer.encode(("" if before else head) + middle + ("" if after else tail),
                                         parse_special=True)
            if after:
                run.append(tail)
        flush()
        return ids


def _message_strings(messages: list[dict]) -> list[str]:
    return [v for m in messages for v in m.values() if isinstance(v, str)]


def _mark_messages(marker: _Marker, messages: list[dict]) -> list[dict]:
    return [{k: marker.mark(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]


def _encode_template(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Render ``messages`` and encode them so that only the template's own markup becomes control tokens
    (``Tokenizer.control_tokens``: the special tokens and the non-special ones the template writes, such as
    Qwen3's ``<think>``).

    Control-token text inside the messages' string values (content, role, name, ...; not nested ones
    such as ``tool_calls``) is swapped for private-use placeholders before rendering; the rendered text
    is split at the placeholders, template pieces are encoded with special tokens parsed and each
    placeholder's original text without. Rows with no control-token text are one piece, encoded as one
    string.
    """
    marker = _Marker(tokenizer, _message_strings(messages))
    return marker.encode(_render(tokenizer, _mark_messages(marker, messages)))


def _render(tokenizer: Tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateCompileError:
        raise  # the model's fault: it stops the run, not this row
    except ChatTemplateError as e:
        raise RowError(str(e)) from None


def _with_bos(tokenizer: Tokenizer, ids: list[int], templated: bool = False) -> list[int]:
    """``ids`` with the BOS id in front where the model asks for one and they do not start with it. ``templated``
    (a rendered chat template): a BOS after only whitespace tokens counts too (a template writing
    ``"\n" + bos_token``), and the ids stay as they are, as ``transformers``' ``apply_chat_template`` leaves them.
    Every prompt's ids pass here.

    Raises:
        RowError: an id at or past ``tokenizer.id_limit`` (an added token the model has no embedding row for).
    """
    limit, top = tokenizer.id_limit, max(ids, default=-1)
    if limit is not None and top >= limit:
        raise RowError(f"the prompt holds token {top} ({tokenizer.decode([top])!r}), past the model's vocabulary "
                       f"of {limit} tokens (the embedding's rows)")
    bos = tokenizer.bos_token_id
    if not tokenizer.add_bos_token or bos is None:
        return ids
    for i in ids:
        if i == bos:
            return ids
        if not templated or tokenizer.decode([i]).strip():
            break
    return [bos, *ids]


def row_messages(row: InputRow, spec: InputSpec, empty_prompt: bool = False) -> tuple[str | None, list[dict] | None]:
    """``(text for the prompt column, messages)``: messages None for a raw prompt (no chat template).

    Args:
        empty_prompt: an empty (not null) prompt is a prompt (``task: score``: an empty context is scored
            after the prefix token, ``encode_pair``); else it fails the row.

    Raises:
        RowError: as ``build_prompt``.
    """
    if row.messages is not None:
        if isinstance(row.messages, list) and len(row.messages) == 0:
            raise RowError(f"input column {spec.messages_column!r} is empty")
        try:
            messages = _check_messages(row.messages)
        except RowError as e:
            raise RowError(f"input column {spec.messages_column!r}: {e}") from None
        users = [m["content"] for m in messages if m["role"] == "user"]
        text = users[-1] if users else None
    else:
        if row.prompt is None or (row.prompt == "" and not empty_prompt):
            state = "is null" if row.prompt is None else "is empty"
            if spec.template is not None:
                raise RowError(f"input.template's prompt {state}")
            col, msgs = spec.prompt_column, spec.messages_column
            if col is None:  # messages only
                raise RowError(f"input column {msgs!r} is null")
            if msgs and row.prompt is None:
                raise RowError(f"input columns {col!r} and {msgs!r} are null")
            raise RowError(f"input column {col!r} {state}" + (f" and {msgs!r} is null" if msgs else ""))
        text = row.prompt
        if not spec.apply_chat_template:
            return text, None
        messages = [{"role": "user", "content": text}]
    if spec.system_prompt is not None and not any(m["role"] in ("system", "developer") for m in messages):
        messages.insert(0, {"role": "system", "content": spec.system_prompt})  # developer: OpenAI's newer system
    return text, messages


def build_prompt(row: InputRow, spec: InputSpec, tokenizer: Tokenizer) -> Prompt:
    """Build the model input for ``row``.

    Rows with non-null ``messages`` use them; otherwise the ``prompt`` text, wrapped as one user turn
    when ``spec.apply_chat_template``. ``spec.system_prompt`` is prepended to conversations that have no
    system (or developer) turn anywhere. With ``spec.parse_special_tokens`` false (the default),
    control-token text (special tokens, and with a chat template the non-special added tokens it writes, such
    as Qwen3's ``<think>``) inside the prompt, the messages or the system prompt is encoded as plain text and
    only the template's own markup becomes those tokens; true encodes the rendered template (or the raw
    prompt) with special tokens parsed, as HF transformers does. BOS is added only if the model asks for it
    and it is not already there (for a chat template, after only whitespace: ``_with_bos``).

    Raises:
        RowError: null or empty prompt, malformed messages (empty, a message without string role and
            content, a role other than system, user, assistant, tool or developer), a template that rejects
            them or that cuts up special-token text of the messages.
    """
    text, messages = row_messages(row, spec)
    if messages is None:
        return Prompt(text, _with_bos(tokenizer, tokenizer.encode(text, parse_special=spec.parse_special_tokens)))
    if spec.parse_special_tokens:
        ids = tokenizer.encode(_render(tokenizer, messages), parse_special=True)
    else:
        ids = _encode_template(tokenizer, messages)
    return Prompt(text, _with_bos(tokenizer, ids, templated=True))


def encode_pair(encode, context: str, continuation: str,
                prefix_token_id: int | None = None) -> tuple[list[int], list[int]]:
    """Context and continuation ids by lm-evaluation-harness's rule (``TemplateLM._encode_pair`` in
    ``lm_eval/api/model.py``): trailing whitespace of ``context`` moves to the start of ``continuation``;
    ``context + continuation`` is encoded whole and split at the length of the encoded context, so a token
    spanning the boundary counts as continuation. A context that encodes to no tokens (``""`` for a model
    that adds no BOS, as lm-eval's ``acc_mutual_info`` sends) becomes ``[prefix_token_id]`` and the whole
    text is continuation, as ``TemplateLM.loglikelihood`` does for ``context == ""``; here a context of only
    whitespace gets the same (lm-eval would score it with no context token at all).

    Args:
        encode: text -> token ids (BOS and special-token handling included).
        context, continuation: the two texts.
        prefix_token_id: ``Tokenizer.prefix_token_id``; None leaves an empty context empty.

    Returns:
        (context ids, continuation ids).
    """
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    if not ctx and prefix_token_id is not None:
        return [prefix_token_id], whole
    return ctx, whole[len(ctx):]


@dataclass
class ScorePrompt:
    """A row's context and continuations as token ids (``task: score``).

    Attributes:
        text: the user text recorded in the output ``prompt`` column, as ``Prompt.text``.
        context_ids: the context's ids (chat template applied, BOS as the model wants it), its trailing
            whitespace moved to the continuations (``encode_pair``).
        continuation_ids: per continuation, its ids.
    """

    text: str | None
    context_ids: list[int]
    continuation_ids: list[list[int]]


def build_score_prompt(row: InputRow, spec: InputSpec, tokenizer: Tokenizer, continuations: list[str]) -> ScorePrompt:
    """The context of ``row`` (the text ``build_prompt`` builds: the raw prompt, or the chat template rendered
    with the generation prompt) and each of ``continuations`` encoded by ``encode_pair``. Special-token text
    in the data (messages, prompt, system prompt, continuations) is plain text unless
    ``spec.parse_special_tokens``, as for generation; BOS is added once where the model asks for it.

    A chat-templated context ends with the template's generation prompt (SmolLM2: ``<|im_start|>assistant\n``):
    its trailing newline moves to each continuation, as lm-evaluation-harness does with
    ``--apply_chat_template``. An empty prompt (not a null one) is an empty context: it is scored after
    ``Tokenizer.prefix_token_id`` (``encode_pair``).

    Raises:
        RowError: as ``build_prompt``.
    """
    text, messages = row_messages(row, spec, empty_prompt=True)
    bos = lambda ids: _with_bos(tokenizer, ids, templated=messages is not None)  # noqa: E731
    if messages is None:
        context = text
        encode = lambda s: bos(tokenizer.encode(s, parse_special=spec.parse_special_tokens))  # noqa: E731
    elif spec.parse_special_tokens:
        context = _render(tokenizer, messages)
        encode = lambda s: bos(tokenizer.encode(s, parse_special=True))  # noqa: E731
    else:
        marker = _Marker(tokenizer, _message_strings(messages) + list(continuations))
        context = _render(tokenizer, _mark_messages(marker, messages))
        continuations = [marker.mark(c) for c in continuations]
        encode = lambda s: bos(marker.encode(s))  # noqa: E731
    pairs = [encode_pair(encode, context, c, tokenizer.prefix_token_id) for c in continuations]
    return ScorePrompt(text, pairs[0][0], [cont for _, cont in pairs])
