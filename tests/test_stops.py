"""Incremental detokenization and stop strings (pipeline.engine.stops) with the real default-model tokenizer,
checked against Hugging Face ``tokenizers``' own ``decode``."""

from __future__ import annotations

import codecs

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from pipeline.gguf import read_gguf
from pipeline.resolve import resolve_model
from pipeline.engine.stops import IncrementalDetokenizer, StopChecker, final_text
from pipeline.errors import RowError
from pipeline.tokenizer import _BYTE_OF_CHAR, Tokenizer, incomplete_utf8

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return read_gguf(resolve_model("smollm2-135m-instruct")).tokenizer


def stream(tok, ids, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return d, [d.push(i) for i in ids]


# --- IncrementalDetokenizer ------------------------------------------------------------------------

TEXTS = [
    "中文字符测试，你好世界",
    "日本語のテキストです。漢字とひらがな",
    "한국어 문장입니다",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "naïve café, Ünïcödé ñ",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    " Hello",
    "  two leading spaces",
    "\n\nnewlines first",
    "\tcode(x) { return 1; }",
    "mixed 中文 and English 😀 text",
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_hf_decode_and_never_split_a_character(tok, text):
    ids = tok.encode(text)
    d, pieces = stream(tok, ids)
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == tok._hf.decode(ids, skip_special_tokens=True) == text
    assert d.text == text and d.token_ids == ids


@pytest.mark.parametrize("text", TEXTS)
def test_text_equals_hf_decode_after_every_push(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    for k, i in enumerate(ids, 1):
        d.push(i)
        assert d.text == tok._hf.decode(ids[:k], skip_special_tokens=True)


@pytest.mark.parametrize("text", ["中文字符测试", "😀👍🏽", "漢字"])
def test_multibyte_characters_are_held_back(tok, text):
    ids = tok.encode(text)
    _, pieces = stream(tok, ids)
    assert "" in pieces  # some token ended inside a character
    assert [c for p in pieces for c in p] == list(text)


def test_incomplete_character_at_the_end(tok):
    ids = tok.encode("符")[:1]  # the first two of its three UTF-8 bytes
    d, pieces = stream(tok, ids)
    assert pieces == [""]
    assert d.text == tok._hf.decode(ids) == "\ufffd"


def test_invalid_byte_inside_the_text_is_kept_as_decode_renders_it(tok):
    lone = tok.encode("符")[1]  # a UTF-8 continuation byte on its own
    ids = tok.encode("ab") + [lone] + tok.encode(" cd")
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == d.text == tok._hf.decode(ids) == "ab\ufffd cd"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", parse_special=True)
    assert ids[0] == IM_START and ids[-1] == IM_END
    d, pieces = stream(tok, ids, skip_special_tokens=skip)
    expected = tok._hf.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == d.text == expected
    assert expected == ("assistant\nHi there" if skip else "<|im_start|>assistant\nHi there<|im_end|>")


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer as Llama 2 / Mistral tokenizer.json files build it: byte-fallback
    tokens, "▁" for spaces, and a decoder that strips the text's leading space."""
    words = ["▁", "▁Hello", "Hello", "▁world", "x", "▁▁", "▁a", "."]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({w: len(vocab) + i for i, w in enumerate(words)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos_token=True, chat_template=None)


def sp_ids(tok, pieces):
    """Ids of ``pieces``: vocabulary entries as they are, other strings as their UTF-8 byte tokens."""
    ids = []
    for p in pieces:
        i = tok._hf.token_to_id(p)
        ids += [i] if i is not None else [tok._hf.token_to_id(f"<0x{b:02X}>") for b in p.encode()]
    return ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("pieces", [
    ["▁Hello", "▁", "▁world", "."],
    ["▁▁", "x", "▁a"],
    ["<s>", "▁Hello", "中", "文", "▁a", "😀", "</s>"],
    ["😀", "▁world", "👍🏽"],
])
def test_byte_fallback_tokenizer(sp_tok, pieces, skip):
    ids = sp_ids(sp_tok, pieces)
    d, out = stream(sp_tok, ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in out), out
    assert "".join(out) == d.text == sp_tok._hf.decode(ids, skip_special_tokens=skip)


def test_invalid_byte_sequence_keeps_text_exact(sp_tok):
    # ByteFallback turns a whole invalid run of byte tokens into U+FFFD, "A" included once the run is
    # invalid, so a prefix's text is not a prefix of the text: DecodeStream raises "Invalid prefix".
    ids = [sp_tok._hf.token_to_id(t) for t in ["<0x41>", "<0xAD>", "<0x41>", "▁a"]]
    library = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            library.step(sp_tok._hf, i)
    d = IncrementalDetokenizer(sp_tok)
    for k, i in enumerate(ids, 1):
        d.push(i)
        assert d.text == sp_tok._hf.decode(ids[:k], skip_special_tokens=True)
    assert d.text == "\ufffd\ufffd\ufffd a"


# --- StopChecker -----------------------------------------------------------------------------------

# (text, stop strings, index of the token whose push reports the match, matched string)
STOP_CASES = [
    ("hello world", ["lo wo"], 1, "lo wo"),  # "hello" | " world"
    (" the quick brown fox", ["e quick b"], 2, "e quick b"),  # spans three tokens
    ("The cat sat on the mat", ["mat", "sat", "cat"], 1, "cat"),
    ("hello world", ["world", "o w"], 1, "o w"),  # both complete on " world": earliest start wins
    ("hello world", ["wor", "world"], 1, "world"),  # same start: the longer wins
    ("中文字符测试，你好世界", ["世界"], None, "世界"),  # completes on the last byte-level token
    ("hello world", ["hello"], 0, "hello"),
    ("hello world", ["planet"], None, None),
]


@pytest.mark.parametrize("text, stop, at, matched", STOP_CASES)
def test_stop_checker(tok, text, stop, at, matched):
    ids = tok.encode(text)
    if at is None and matched is not None:
        at = len(ids) - 1
    checker = StopChecker(tok, stop)
    results = [checker.push(i) for i in ids]
    first = next(((k, r) for k, r in enumerate(results) if r is not None), (None, None))
    assert first == (at, matched)
    if matched is not None:  # a real token boundary inside the match (except single-token matches)
        before = tok.decode(ids[:at])
        assert matched not in before and matched in tok.decode(ids[: at + 1])


def test_stop_checker_reports_each_occurrence_once(tok):
    ids = tok.encode("hello world")
    checker = StopChecker(tok, ["lo"])
    assert [checker.push(i) for i in ids] == ["lo", None]


def test_stop_checker_special_token_text(tok):
    ids = tok.encode("Hi<|im_end|>", parse_special=True)
    assert ids[-1] == IM_END
    kept = StopChecker(tok, ["<|im_end|>"], skip_special_tokens=False)
    assert [kept.push(i) for i in ids] == [None, "<|im_end|>"]
    skipped = StopChecker(tok, ["<|im_end|>"], skip_special_tokens=True)
    assert [skipped.push(i) for i in ids] == [None, None]


def test_stop_checker_without_stop_strings(tok):
    checker = StopChecker(tok, [])
    assert [checker.push(i) for i in tok.encode("hello world")] == [None, None]


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None]])
def test_empty_stop_string_is_an_error(tok, bad):
    with pytest.raises(RowError, match="non-empty"):
        StopChecker(tok, bad)
    with pytest.raises(RowError, match="non-empty"):
        final_text(tok, [1], bad)


# --- final_text ------------------------------------------------------------------------------------

# (text, stop strings, include_stop_str_in_output, min_end, expected completion, matched)
FINAL_CASES = [
    ("hello world, hello moon", ["lo w"], False, 0, "hel", "lo w"),
    ("hello world, hello moon", ["lo w"], True, 0, "hello w", "lo w"),
    ("hello world, hello moon", ["moon", "world"], False, 0, "hello ", "world"),
    ("hello world, hello moon", ["wor", "world"], True, 0, "hello world", "world"),
    ("hello world, hello moon", ["hello"], False, 5, "hello world, ", "hello"),  # first one ends at 5
    ("hello world, hello moon", ["hello"], False, 4, "", "hello"),
    ("hello world, hello moon", ["planet"], False, 0, "hello world, hello moon", None),
    ("hello world, hello moon", [], True, 0, "hello world, hello moon", None),
    ("中文字符测试，你好世界", ["你好"], False, 0, "中文字符测试，", "你好"),
]


@pytest.mark.parametrize("text, stop, include, min_end, completion, matched", FINAL_CASES)
def test_final_text(tok, text, stop, include, min_end, completion, matched):
    ids = tok.encode(text)
    assert tok._hf.decode(ids) == text
    assert final_text(tok, ids, stop, include_stop_str_in_output=include, min_end=min_end) == (completion, matched)


@pytest.mark.parametrize("skip", [True, False])
def test_final_text_is_decode_when_nothing_matches(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>", parse_special=True)
    expected = tok._hf.decode(ids, skip_special_tokens=skip)
    assert final_text(tok, ids, ["nope"], skip_special_tokens=skip) == (expected, None)


@pytest.mark.parametrize("text, stop, at, matched", [c for c in STOP_CASES if c[3] is not None])
def test_checker_and_final_text_agree(tok, text, stop, at, matched):
    ids = tok.encode(text)
    checker = StopChecker(tok, stop)
    for k, i in enumerate(ids, 1):
        if checker.push(i) is not None:
            break
    completion, found = final_text(tok, ids[:k], stop)
    text = tok.decode(ids[:k])
    assert found == matched and completion == text[: text.find(matched)]


# --- the completion ends at its last complete character (decode_complete) --------------------------

def _python_held(data: bytes) -> int:
    """Bytes at the end of ``data`` that CPython's UTF-8 decoder reports as "unexpected end of data"."""
    errors = []

    def record(e):
        errors.append(e)
        return "\ufffd", e.end

    codecs.register_error("pipeline-test-record", record)
    data.decode("utf-8", errors="pipeline-test-record")
    last = errors[-1] if errors else None
    return last.end - last.start if last and last.end == len(data) and last.reason == "unexpected end of data" else 0


def test_incomplete_utf8_agrees_with_cpython():
    cases = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    cases += [bytes([a, b, c]) for a in (0x61, 0xC3, 0xE0, 0xE4, 0xED, 0xEF, 0xF0, 0xF3, 0xF4, 0xF5)
              for b in range(0x70, 0xC1) for c in range(0x70, 0xC1)]
    assert [incomplete_utf8(b) for b in cases] == [_python_held(b) for b in cases]
    assert incomplete_utf8("😀".encode()[:3]) == 3 and incomplete_utf8("😀".encode()) == 0
    assert incomplete_utf8(b"\xed\xa0") == 0  # a surrogate's start: never valid, so not held


def byte_ids(tok, data: bytes) -> list[int] | None:
    """One byte-level token per byte, or None when the vocabulary lacks one of them (SmolLM2's lacks 21,
    such as 0x04, 0xC0 and 0xF1)."""
    ids = [tok._hf.token_to_id(_BYTE_CHAR[b]) for b in data]
    return None if None in ids else ids


_BYTE_CHAR = {b: c for c, b in _BYTE_OF_CHAR.items()}


def test_byte_alphabet_is_tokenizers_own(tok):
    """pipeline's table of byte-level characters decodes as tokenizers' ByteLevel decoder does, for every
    continuation byte and every lead byte the vocabulary has a token of."""
    assert sorted(_BYTE_CHAR) == list(range(256))
    chars = [chr(c) for c in range(0x800)] + [chr((i << 12) | 0x800) for i in range(16) if i != 13]
    chars += ["\ud7ff", "\ufffd"] + [chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000)]
    covered = set()
    for c in chars:
        ids = byte_ids(tok, c.encode())
        if ids is not None:
            assert tok._hf.decode(ids) == c
            covered.update(c.encode())
    assert set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1)) | {0xF3, 0xF4} <= covered


def cut_inside_last_character(tok, text: str) -> list[int]:
    """The ids of ``text`` with tokens dropped from the end until they stop inside a character."""
    ids = tok.encode(text)
    while not tok._hf.decode(ids).endswith("\ufffd"):
        ids = ids[:-1]
    return ids


def test_decode_complete_drops_only_an_unfinished_last_character(tok):
    cut_inside = set()
    for text in TEXTS:  # every prefix of their ids
        ids = tok.encode(text)
        for k in range(len(ids) + 1):
            full = tok._hf.decode(ids[:k])
            got = tok.decode_complete(ids[:k])
            assert text.startswith(got) and "\ufffd" not in got
            if full.endswith("\ufffd"):  # tokenizers renders the unfinished character as one U+FFFD
                cut_inside.add(text)
                assert got == full[:-1]
            else:
                assert got == full
    assert {TEXTS[0], TEXTS[1], TEXTS[3]} <= cut_inside  # Chinese, Japanese, emoji


def test_decode_complete_keeps_a_real_replacement_character(tok):
    fffd = "\ufffd".encode()  # EF BF BD
    assert tok.decode_complete(tok.encode("ab\ufffd")) == "ab\ufffd"
    assert tok.decode_complete(tok.encode("ab") + byte_ids(tok, fffd)) == "ab\ufffd"
    assert tok.decode_complete(tok.encode("ab") + byte_ids(tok, fffd[:2])) == "ab"  # U+FFFD itself unfinished
    emoji = byte_ids(tok, "😀".encode())
    for k in (1, 2, 3):
        ids = tok.encode("x\ufffd") + emoji[:k]
        assert tok._hf.decode(ids) == "x\ufffd\ufffd"
        assert tok.decode_complete(ids) == "x\ufffd"
    lone = tok.encode("符")[1]  # a continuation byte no later byte can make valid: kept as decode renders it
    assert tok.decode_complete(tok.encode("ab") + [lone]) == tok._hf.decode(tok.encode("ab") + [lone]) == "ab\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_decode_complete_with_a_special_token_after_the_cut(tok, skip):
    ids = cut_inside_last_character(tok, "Hi 😀") + [IM_END]
    full = tok._hf.decode(ids, skip_special_tokens=skip)
    if skip:  # the skipped token adds no bytes: the character is still unfinished at the end
        assert full.endswith("\ufffd") and tok.decode_complete(ids, skip_special_tokens=True) == full[:-1]
    else:  # text follows it: it never finishes, and stays as decode renders it
        assert tok.decode_complete(ids) == full and full.endswith("\ufffd<|im_end|>")


@pytest.mark.parametrize("stop, include, completion, matched", [
    ([], False, "hello world ", None),
    (["never"], True, "hello world ", None),
    (["world"], False, "hello ", "world"),
    (["world"], True, "hello world", "world"),
    (["d "], True, "hello world ", "d "),
])
def test_final_text_of_a_cut_character_with_stop_strings(tok, stop, include, completion, matched):
    ids = cut_inside_last_character(tok, "hello world 😀")
    assert final_text(tok, ids, stop, include_stop_str_in_output=include) == (completion, matched)


@pytest.mark.parametrize("cut", [1, 2])
def test_decode_complete_byte_fallback(sp_tok, cut):
    ids = sp_ids(sp_tok, ["▁Hello", "中", "文"])  # 中 and 文 are byte tokens: 3 each
    assert sp_tok.decode_complete(ids) == sp_tok._hf.decode(ids) == "Hello中文"
    part = ids[: len(ids) - 3 + cut]
    assert sp_tok._hf.decode(part) == "Hello" + "\ufffd" * (3 + cut)  # the whole invalid run as U+FFFD
    assert sp_tok.decode_complete(part) == "Hello中"
    fffd = sp_ids(sp_tok, ["▁a", "\ufffd"])  # a real U+FFFD as byte tokens EF BF BD
    assert sp_tok.decode_complete(fffd) == sp_tok._hf.decode(fffd) == "a\ufffd"
    unfinished = fffd + sp_ids(sp_tok, ["😀"])[:cut]
    assert sp_tok._hf.decode(unfinished) == "a" + "\ufffd" * (3 + cut)
    assert sp_tok.decode_complete(unfinished) == "a\ufffd"


def test_decode_complete_is_decode_for_text_decoders():
    vocab = {"[UNK]": 0, "a": 1, "\ufffd": 2}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    t = Tokenizer(hf, bos_token_id=None, eos_token_ids=[], add_bos_token=False, chat_template=None)
    assert t.decode_complete([1, 2]) == t.decode([1, 2]) == "a \ufffd"


def test_a_stop_string_held_back_at_max_tokens_still_ends_the_row(tok, tmp_path):
    """The last token holds the stop's last character and the first bytes of an emoji: the incremental
    detokenizer holds that piece back, so no push reports the stop. The row ends at max_tokens; its
    completion (decode of the complete characters) must still be cut before the stop, and say so."""
    import mlx.core as mx

    from pipeline.engine import Engine, GenerateParams
    from pipeline.engine.request import Decoding
    from pipeline.loader import load_model
    from tiny_model import write_tiny_model

    ids = tok.encode("Answer: 🎉")
    ids = ids[:-1]  # the emoji's last bytes are in the last token
    assert tok.decode(ids).endswith("\ufffd") and tok.decode_complete(ids) == "Answer: "
    lm = load_model(str(write_tiny_model(tmp_path / "model")))  # the default model's tokenizer
    engine = Engine(lm.model, tok.eos_token_ids, lm.engine.context_length, tokenizer=tok)
    for include, text in ((False, "Answer"), (True, "Answer: ")):
        d = Decoding(engine, [1, 2, 3], GenerateParams(max_tokens=len(ids), stop=(": ",),
                                                       include_stop_str_in_output=include))
        d.begin(mx.zeros((1, lm.model.args.vocab_size)))
        d.t_first = d.t0 + 1e-3
        assert [d.push(i, ()) for i in ids] == [None] * (len(ids) - 1) + [("length", None, None)]
        gen = d.finish(("length", None, None), compiled=False)
        assert (gen.text, gen.finish_reason, gen.stop_reason, gen.stop_token_id) == (text, "stop", ": ", None)
