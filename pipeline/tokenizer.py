"""Tokenizer: a Hugging Face ``tokenizers.Tokenizer`` plus the model's special tokens and chat template.

Built from GGUF metadata (``tokenizer.ggml.*``) so that token ids match llama.cpp's tokenizer for the
same file (checked against llama.cpp reference ids in ``tests/fixtures``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .chat_template import render_chat_template, template_literal_text

log = logging.getLogger("pipeline")

# llama.cpp token types (llama.cpp: `enum llama_token_type` / gguf-py `TokenType`).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer regexes, from llama.cpp `llama_vocab::impl::load` (llama-vocab.cpp) and the matching
# `pre_tokenizer` sections of the models' Hugging Face tokenizer.json files.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _llama3_split():
    return _split_then_bytes(_LLAMA3_REGEX)


def _digits_then_gpt2():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# GGUF `tokenizer.ggml.pre` value -> (HF pre-tokenizer factory, BPE ignore_merges).
_PRE_TOKENIZERS = {
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "smollm": (_digits_then_gpt2, False),
    "starcoder": (_digits_then_gpt2, False),
    "refact": (_digits_then_gpt2, False),
    "llama-bpe": (_llama3_split, True),
    "llama3": (_llama3_split, True),  # llama.cpp's other names of llama-bpe
    "llama-v3": (_llama3_split, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_REGEX), False),
}

# Pre-tokenizers after which llama.cpp adds BOS when a GGUF has no tokenizer.ggml.add_bos_token
# (llama.cpp src/llama-vocab.cpp, the LLAMA_VOCAB_PRE_TYPE_LLAMA3 arm: add_bos = true).
_ADD_BOS_PRE = {"llama3", "llama-v3", "llama-bpe"}


# Lead bytes whose second byte has a narrower range than 80..BF (Unicode 15.0, Table 3-7, well-formed UTF-8).
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token, as tokenizers' ByteFallback decoder reads it


def _byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level token stands for: GPT-2's ``bytes_to_unicode`` inverted
    (openai/gpt-2 ``src/encoder.py``; the alphabet of ``tokenizers``' ByteLevel decoder)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(moved)}}


_BYTE_OF_CHAR = _byte_of_char()


def incomplete_utf8(data: bytes) -> int:
    """How many bytes at the end of ``data`` (0-3) begin a UTF-8 character without finishing it: a proper
    prefix of a well-formed sequence (Unicode 15.0, Table 3-7), which later bytes could still complete.
    Bytes that no continuation can make valid (a stray continuation byte, ``ED A0``) count as finished."""
    for n in range(1, min(3, len(data)) + 1):
        lead = data[-n]
        if 0x80 <= lead <= 0xBF:
            continue
        size = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
        if n >= size:
            return 0
        lo, hi = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        return n if n == 1 or lo <= data[-n + 1] <= hi else 0
    return 0


class TokenizerError(ValueError):
    """The tokenizer described by the model files is missing or not supported."""


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model.

    Attributes:
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: every id that ends a generation (a sorted tuple of ints): the declared EOS ids
            plus the chat template's end-of-turn token (see ``_end_of_turn_id``).
        add_bos_token: whether a BOS token is prepended to prompts (the model's own setting).
        chat_template: jinja2 source of the chat template, or None.
        id_limit: the model's ``vocab_size`` (its embedding's rows), set by ``load_model``: prompts holding an id
            at or past it fail their row (``prompts``); None: not checked.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
    ):
        self._hf = hf
        self.id_limit: int | None = None
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        declared = list(eos_token_ids)
        self._eos_id = declared[0] if declared else None  # the model's own EOS: `eos_token` in templates
        eot = _end_of_turn_id(hf, chat_template, self.bos_token, self.eos_token)
        self.eos_token_ids = tuple(sorted(set(declared) | ({eot} if eot is not None else set())))

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def base_vocab_end(self) -> int:
        """One past the largest id of the model's own vocabulary (added tokens left out): the ids ordinary text
        encodes to are below it."""
        return max(self._hf.get_vocab(with_added_tokens=False).values(), default=-1) + 1

    def to_str(self) -> str:
        """The Hugging Face ``tokenizer.json`` text of this tokenizer (as ``tokenizers.Tokenizer.to_str``)."""
        return self._hf.to_str()

    @property
    def bos_token(self) -> str:
        return "" if self.bos_token_id is None else self._hf.id_to_token(self.bos_token_id)

    @property
    def prefix_token_id(self) -> int | None:
        """The token a loglikelihood context that encodes to nothing is replaced by: BOS, else the first
        declared EOS id, else None (lm-evaluation-harness's ``prefix_token_id``, ``lm_eval/models/huggingface.py``:
        ``bos_token_id`` if not None, else ``eos_token_id``)."""
        return self.bos_token_id if self.bos_token_id is not None else self._eos_id

    @property
    def eos_token(self) -> str:
        """Text of the first declared EOS id (the tokenizer's own ``eos_token``), or ""."""
        return "" if self._eos_id is None else self._hf.id_to_token(self._eos_id)

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """Text of every special added token (those ``encode`` turns into their ids only with
        ``parse_special``), longest first."""
        added = self._hf.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}, key=lambda c: (-len(c), c)))

    @cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """Text of the added tokens that are chat markup, longest first: every special one and the non-special
        ones the chat template writes as literal text (Qwen3's ``<think>``, ``<tool_call>``), whitespace tokens
        aside. ``transformers``' rule for ``apply_chat_template(sanitize_control_tokens=True)``
        (``PreTrainedTokenizerBase._get_control_tokens``, without a ``chat_control_tokens`` list).

        Raises:
            ChatTemplateCompileError: the chat template does not compile.
        """
        literal = template_literal_text(self.chat_template) if self.chat_template else ""
        added = self._hf.get_added_tokens_decoder().values()
        written = {t.content for t in added if not t.special and t.content and not t.content.isspace()
                   and t.content in literal}
        return tuple(sorted(set(self.special_tokens) | written, key=lambda c: (-len(c), c)))

    def encode_data(self, text: str) -> list[int]:
        """Token ids of ``text`` with every control token in it (``control_tokens``) encoded as plain text, as
        ``encode`` encodes special tokens; other non-special added tokens become their ids, as in ``encode``."""
        hf = self._hf_data
        hf.encode_special_tokens = True
        return hf.encode(text, add_special_tokens=False).ids

    @cached_property
    def _hf_data(self) -> HFTokenizer:
        """The tokenizer with its non-special control tokens marked special, so that ``encode_special_tokens``
        leaves them as text too; the tokenizer itself when there are none."""
        extra = set(self.control_tokens) - set(self.special_tokens)
        if not extra:
            return self._hf
        spec = json.loads(self._hf.to_str())
        for t in spec["added_tokens"]:
            if t["content"] in extra:
                t["special"] = True
        return HFTokenizer.from_str(json.dumps(spec))

    def encode(self, text: str, *, parse_special: bool = False, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            parse_special: when True, special-token strings in ``text`` (such as ``<|im_start|>``)
                become their ids; when False they are encoded as ordinary text.
            add_bos: prepend the BOS id unless ``text`` already starts with it.

        Returns:
            A list of int token ids.
        """
        self._hf.encode_special_tokens = not parse_special
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (byte-level tokens joined before UTF-8 decoding)."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_complete(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """``decode(ids)`` up to its last complete character, as vLLM's incremental detokenizer shows it.

        Bytes at the end that begin a multi-byte UTF-8 character the ids do not finish (a generation cut
        by ``max_tokens`` inside one), which ``decode`` renders as U+FFFD, are left out; with a
        byte-fallback decoder the rest of their run of byte tokens keeps its characters (``decode`` turns
        the whole run into U+FFFD). A U+FFFD the ids spell in full (bytes ``EF BF BD``, or a token of
        that text) and bytes no continuation can make valid stay as ``decode`` renders them. Only
        byte-level (GPT-2 style) and byte-fallback (``<0xNN>`` tokens) decoders split characters; with
        any other decoder this is ``decode``.
        """
        text = self.decode(ids, skip_special_tokens=skip_special_tokens)
        if not text.endswith("\ufffd") or self._byte_decoding is None:
            return text
        tail, owner = b"", []  # the raw bytes of the last tokens, and the index in ids of each byte's token
        for k in range(len(ids) - 1, -1, -1):
            data = self._token_bytes(ids[k], skip_special_tokens)
            if data is None:
                break
            tail, owner = data + tail, [k] * len(data) + owner
            if len(tail) >= 4:  # a character has at most 4 bytes
                break
        held = incomplete_utf8(tail)
        if not held:
            return text
        if self._byte_decoding == "byte_level":  # one lossy UTF-8 decode of all bytes: one U+FFFD for them
            return text[:-1]
        drop = set(owner[-held:])  # byte fallback: one token per byte
        return self.decode([t for k, t in enumerate(ids) if k not in drop], skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_decoding(self) -> str | None:
        """"byte_level" (every token stands for bytes), "byte_fallback" (``<0xNN>`` tokens stand for one
        byte each) or None (tokens are text), from the decoder's own description."""
        decoder = json.loads(self._hf.to_str()).get("decoder") or {}
        parts = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
        types = {d.get("type") for d in parts}
        return "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else None

    @cached_property
    def _added_tokens(self) -> dict:
        return self._hf.get_added_tokens_decoder()

    def _token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes | None:
        """What ``token_id`` adds to the decoded bytes: b"" for a skipped special token, None for a token
        that is text (whole characters), as ``tokenizers``' ByteLevel / ByteFallback decoders read it."""
        added = self._added_tokens.get(token_id)
        if added is not None and added.special and skip_special_tokens:
            return b""
        token = self._hf.id_to_token(token_id)
        if token is None:
            return None
        if self._byte_decoding == "byte_level":  # characters outside the alphabet: the token's own UTF-8
            return bytes(_BYTE_OF_CHAR[c] for c in token) if all(c in _BYTE_OF_CHAR for c in token) else token.encode()
        m = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(m[1], 16)]) if m else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template; returns the prompt text.

        Raises:
            TokenizerError: the model has no chat template.
            ChatTemplateError: the template rejected the messages.
        """
        if not self.chat_template:
            raise TokenizerError("the model has no chat template (set input.apply_chat_template: false)")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    @classmethod
    def from_model_dir(cls, path, *, extra_eos_ids: Sequence[int] = (), bos_token_id: int | None = None) -> Tokenizer:
        """Build from a HF model directory: ``tokenizer.json``, ``tokenizer_config.json`` (special tokens,
        ``add_bos_token``, ``chat_template``) and ``chat_template.jinja``.

        ``add_bos_token`` comes from ``tokenizer_config.json`` when it says; otherwise it is whether the
        tokenizer's own post-processor prepends the BOS token (as Llama 3's does). The chat template is
        ``chat_template.jinja`` when the directory has one, else ``tokenizer_config.json``'s (transformers'
        order: ``PreTrainedTokenizerBase.from_pretrained`` reads the file over the config's key).

        ``bos_token_id`` (from ``config.json``) is the BOS id when the config names no ``bos_token``.

        Raises:
            TokenizerError: ``tokenizer.json`` missing or unreadable; ``tokenizer_config.json`` not a JSON object
                or a ``bos_token``/``eos_token`` that is not a string; ``chat_template.jinja`` not UTF-8; a
                ``chat_template`` in ``tokenizer_config.json`` that is not a string or a list of named templates.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: file not found (only fast tokenizers, tokenizer.json, are supported)")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise TokenizerError(f"{tok_file}: cannot load ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        except ValueError as e:
            raise TokenizerError(f"{cfg_file}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise TokenizerError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")

        def token_id(key):
            content = _token_content(cfg_file, key, cfg.get(key))
            return None if content is None else hf.token_to_id(content)

        bos = token_id("bos_token")
        if bos is None and bos_token_id is not None:
            bos = bos_token_id
        eos = [i for i in [token_id("eos_token"), *extra_eos_ids] if i is not None]
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:
            probe = hf.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # wins over tokenizer_config.json's, as in transformers (and so mlx-lm, vLLM)
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{jinja_file}: not UTF-8 text ({e})") from None
        else:
            template = _config_chat_template(cfg_file, cfg.get("chat_template"))
        return cls(hf, bos_token_id=bos, eos_token_ids=eos, add_bos_token=add_bos, chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> Tokenizer:
        """Build the tokenizer described by GGUF metadata (``tokenizer.ggml.*`` keys).

        Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the pre-tokenizers listed
        in ``_PRE_TOKENIZERS``. Without ``tokenizer.ggml.add_bos_token``, BOS is added after the Llama 3
        pre-tokenizers (``_ADD_BOS_PRE``, as llama.cpp) and not after the others.

        Raises:
            TokenizerError: another tokenizer model or pre-tokenizer, or missing keys.
        """
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer.ggml.model {kind!r} (supported: 'gpt2' byte-level BPE)")
        pre = md.get("tokenizer.ggml.pre", "gpt2")
        if pre not in _PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported GGUF tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
            )
        try:
            tokens = md["tokenizer.ggml.tokens"]
            merges = md["tokenizer.ggml.merges"]
        except KeyError as e:
            raise TokenizerError(f"GGUF metadata lacks {e.args[0]}") from None
        types = _as_list(md.get("tokenizer.ggml.token_type")) or [_TOKEN_NORMAL] * len(tokens)

        make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            ignore_merges=ignore_merges,
            byte_fallback=False,
            fuse_unk=False,
        )
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = make_pre()
        hf.decoder = decoders.ByteLevel()
        # llama.cpp parses CONTROL tokens only when asked to (parse_special) and USER_DEFINED tokens
        # always (llama-vocab.cpp, tokenizer_st_partition); HF's special/non-special added tokens match.
        hf.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        )
        hf.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == _TOKEN_USER_DEFINED
            ]
        )

        def _int(key):
            v = md.get(key)
            return None if v is None else int(_scalar(v))

        bos = _int("tokenizer.ggml.bos_token_id")
        eos = _int("tokenizer.ggml.eos_token_id")
        eot = _int("tokenizer.ggml.eot_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"GGUF metadata tokenizer.chat_template must be a string, got {_scalar(template)!r:.60}")
        return cls(
            hf,
            bos_token_id=bos,
            eos_token_ids=[i for i in (eos, eot) if i is not None],
            add_bos_token=bool(_scalar(add_bos)) if add_bos is not None else pre in _ADD_BOS_PRE,
            chat_template=template,
        )


# Contents of the probe conversation: plain words no template rewrites and no tokenizer merges with markup.
_PROBE_USER, _PROBE_ASSISTANT = "pipelineProbeUserTurn", "pipelineProbeAssistantTurn"


def _end_of_turn_id(hf: HFTokenizer, template: str | None, bos_token: str, eos_token: str) -> int | None:
    """The id of the special token that the chat template writes right after an assistant message.

    Renders a user + assistant conversation (``add_generation_prompt=False``) and takes the text after
    the assistant's content; if, after optional whitespace (Llama 2 writes ``' ' + eos_token``), it starts
    with a special added token (ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``, Gemma ``<end_of_turn>``),
    returns that token's id (the longest one matching). Chat models end their replies with this token,
    which some models do not declare as EOS.

    Returns:
        The id, or None: no template, a template that fails on this conversation, or no special token there.
    """
    if not template:
        return None
    messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    try:
        text = render_chat_template(template, messages, add_generation_prompt=False,
                                    bos_token=bos_token, eos_token=eos_token)
    except Exception as e:  # templates raise anything (their own errors, TypeError, ...); the declared EOS ids stand
        log.warning("the chat template failed on a user + assistant conversation (%s: %s); only the "
                    "declared EOS ids stop generation", type(e).__name__, e)
        return None
    at = text.rfind(_PROBE_ASSISTANT)
    if at < 0:
        return None
    after = text[at + len(_PROBE_ASSISTANT):].lstrip()
    specials = [(t.content, i) for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content]
    matches = [(len(content), i) for content, i in specials if after.startswith(content)]
    return max(matches)[1] if matches else None


def _config_chat_template(cfg_file: Path, value) -> str | None:
    """``tokenizer_config.json``'s ``chat_template``: a string, null, or named templates
    (``[{"name": ..., "template": ...}]``, of which the one named "default").

    Raises:
        TokenizerError: any other value, named with the file and key.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        return next((t["template"] for t in value if t.get("name") == "default"), None)
    raise TokenizerError(f"{cfg_file}: chat_template must be a string or a list of {{name, template}} objects, "
                         f"got {value!r:.60}")


def _token_content(cfg_file: Path, key: str, value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}`` (or null).

    Raises:
        TokenizerError: anything else (a number, a list), naming the file and key.
    """
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise TokenizerError(f"{cfg_file}: {key} must be a string or {{\"content\": string}}, got {value!r:.60}")
    return content


def _scalar(v):
    return v.item() if hasattr(v, "item") else v


def _as_list(v):
    if v is None:
        return None
    return v.tolist() if hasattr(v, "tolist") else list(v)
