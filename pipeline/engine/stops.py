"""Incremental detokenization and stop strings (``stop`` / ``include_stop_str_in_output`` as in vLLM's
``SamplingParams``)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from ..errors import RowError
from ..tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text of a token stream, one token at a time.

    Built on ``tokenizers.decoders.DecodeStream`` (Hugging Face ``tokenizers`` >= 0.21.1), which runs the
    prefix/read-offset algorithm of TGI and vLLM: each step decodes a short window of recent ids and
    holds text back while it ends in U+FFFD (a multi-byte UTF-8 character not yet complete). If the
    stream fails (``tokenizers`` raises "Invalid prefix encountered" for decoders that rewrite earlier
    text, such as WordPiece's clean-up of " ' "), it decodes every id on each push from then on; pieces
    are then best effort, ``text`` stays exact.

    Args:
        tokenizer: the model's tokenizer.
        skip_special_tokens: leave special tokens out of the text, as ``Tokenizer.decode`` does.

    Attributes:
        token_ids: every id pushed so far.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self._text = ""
        self._complete = True  # self._text == tokenizer.decode(self.token_ids)
        self._decoded = ""  # after a stream failure: the last full decode, trailing U+FFFD removed

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes ("" while a character is incomplete or
        the token is a skipped special token). Pieces never hold a split character."""
        self.token_ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tokenizer._hf, token_id)
            except Exception:  # tokenizers raises a plain Exception ("Invalid prefix encountered")
                self._stream = None
                self._decoded = self._text
            else:
                self._complete = piece is not None
                piece = piece or ""
                self._text += piece
                return piece
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip)
        stable = full.rstrip("\ufffd")
        piece = stable[len(self._decoded):]  # best effort where the decoder rewrote earlier text
        self._decoded = stable
        self._text += piece
        self._complete = self._text == full
        return piece

    @property
    def text(self) -> str:
        """``tokenizer.decode(token_ids, skip_special_tokens=...)``: the pushed pieces joined, plus any
        held-back tail as ``decode`` renders it (U+FFFD for an incomplete character)."""
        if self._complete:
            return self._text
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip)


def _check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise RowError(f"stop strings must be non-empty strings, got {s!r}")
    return stop


def _earliest(text: str, stop: Sequence[str], min_end: int = 0) -> tuple[int, str] | None:
    """The stop string occurrence in ``text`` that ends after character ``min_end`` and starts
    earliest (ties: the longer string), as ``(start, stop string)``; None if there is none."""
    best = None
    for s in stop:
        i = text.find(s, max(0, min_end - len(s) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


class StopChecker:
    """Finds stop strings in generated text as tokens arrive, including matches that span tokens.

    Each push searches only the last ``len(longest stop) - 1`` characters of earlier text plus the new
    text, so it costs O(new text + longest stop) per stop string.

    Args:
        tokenizer: the model's tokenizer.
        stop: the stop strings (non-empty). With none, ``push`` does nothing and returns None.
        skip_special_tokens: match against text without special tokens (as the completion is decoded).

    Attributes:
        detokenizer: the ``IncrementalDetokenizer`` of the pushed ids (left empty without stop strings).

    Raises:
        RowError: an empty or non-string stop string (a request's settings).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], *, skip_special_tokens: bool = True):
        self.stop = _check_stop(stop)
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._keep = max(map(len, self.stop), default=1) - 1
        self._tail = ""

    def push(self, token_id: int) -> str | None:
        """Add one generated id; returns the stop string that now ends in the text (the occurrence that
        starts earliest; ties: the longer string), or None. Each occurrence is reported once, by the push
        whose text completes it."""
        if not self.stop:
            return None
        piece = self.detokenizer.push(token_id)
        if not piece:
            return None
        window = self._tail + piece
        found = _earliest(window, self.stop, min_end=len(self._tail))
        self._tail = window[-self._keep:] if self._keep else ""
        return None if found is None else found[1]


def final_text(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    stop: Sequence[str] = (),
    *,
    skip_special_tokens: bool = True,
    include_stop_str_in_output: bool = False,
    min_end: int = 0,
) -> tuple[str, str | None]:
    """The completion text of ``ids`` and the stop string that ended it.

    The text is ``tokenizer.decode_complete(ids, skip_special_tokens=...)`` (``decode`` up to the last
    complete character: the bytes of a character the ids begin but do not finish are left out, as the
    incremental detokenizer holds them back, so stop strings are matched on the text they were found
    in), cut at the earliest stop string occurrence (ties: the longer string) that ends after character
    ``min_end``; the stop string is kept when ``include_stop_str_in_output`` (vLLM's ``SamplingParams``
    semantics).

    Returns:
        ``(text, matched stop string or None)``.

    Raises:
        RowError: an empty or non-string stop string (a request's settings).
    """
    text = tokenizer.decode_complete(ids, skip_special_tokens=skip_special_tokens)
    found = _earliest(text, _check_stop(stop), min_end)
    if found is None:
        return text, None
    start, s = found
    return text[: start + len(s) if include_stop_str_in_output else start], s
