"""Completion text and stop strings through the engine on the real default model."""

import pytest

from pipeline.engine import GenerateParams
from pipeline.engine.stops import IncrementalDetokenizer

N = 24


def chat_ids(lm, text):
    tok = lm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), parse_special=True,
                      add_bos=tok.add_bos_token)


@pytest.fixture(scope="module")
def story(default_model):
    ids = chat_ids(default_model, "Write a very short story about a robot who learns to garden.")
    g = default_model.engine.generate(ids, GenerateParams(max_tokens=N, ignore_eos=True))
    return ids, g


def spanning_stop(tok, out_ids):
    """A 4-character stop string made of the last 2 characters of token i's text and the first 2 of
    token i + 1's, occurring first at that boundary; returns (stop, i)."""
    texts = [tok.decode(out_ids[: j + 1]) for j in range(len(out_ids))]
    for i in range(3, len(out_ids) - 1):
        a, b = texts[i], texts[i + 1]
        new = b[len(a):]
        if b.startswith(a) and len(new) >= 2 and len(a) - len(texts[i - 1]) >= 2:
            stop = a[-2:] + new[:2]
            if b.find(stop) == len(a) - 2:
                return stop, i
    raise AssertionError("no token boundary to span")


def test_completion_is_the_decoded_ids(default_model, story):
    _, g = story
    assert g.text == default_model.tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert len(g.token_ids) == N and g.finish_reason == "length" and g.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(default_model, story, include):
    ids, g = story
    tok = default_model.tokenizer
    stop, i = spanning_stop(tok, g.token_ids)
    s = default_model.engine.generate(ids, GenerateParams(max_tokens=N, ignore_eos=True, stop=(stop, "never-there"),
                                                          include_stop_str_in_output=include))
    full = tok.decode(g.token_ids)
    cut = full.find(stop)
    assert (s.finish_reason, s.stop_reason, s.stop_token_id) == ("stop", stop, None)
    assert s.token_ids == g.token_ids[: i + 2]  # generation ended on the token completing the match
    assert s.text == full[: cut + len(stop) if include else cut]


def test_earliest_of_several_stop_strings_wins(default_model, story):
    ids, g = story
    full = default_model.tokenizer.decode(g.token_ids)
    words = full.split()
    early = words[2]
    late = next(w for w in reversed(words) if full.find(w) > full.find(early) + len(early))
    s = default_model.engine.generate(ids, GenerateParams(max_tokens=N, ignore_eos=True, stop=(late, early)))
    assert s.stop_reason == early and s.text == full[: full.find(early)]


def test_min_tokens_defers_stop_strings(default_model, story):
    ids, g = story
    tok = default_model.tokenizer
    stop, i = spanning_stop(tok, g.token_ids)
    s = default_model.engine.generate(ids, GenerateParams(max_tokens=N, ignore_eos=True, stop=(stop,),
                                                          min_tokens=i + 3))
    full = tok.decode(g.token_ids)
    later = full.find(stop, full.find(stop) + 1)
    assert s.finish_reason == ("stop" if later >= 0 else "length")
    assert len(s.token_ids) >= i + 3
    assert s.text == (full[:later] if later >= 0 else full)


@pytest.mark.parametrize("after", [0, 1], ids=["completed-after-the-first-min_tokens", "completed-by-the-last-of-them"])
def test_min_tokens_lets_a_stop_string_end_only_after_its_first_tokens(default_model, story, after):
    """As vLLM's detokenizer (vllm/v1/engine/detokenizer.py, PR #22014): a stop string ends a generation only
    where it ends in the text of a token after the first ``min_tokens``; one completed by the ``min_tokens``-th
    token is passed over (it ended the generation there, one token early)."""
    ids, g = story
    tok = default_model.tokenizer
    stop, i = spanning_stop(tok, g.token_ids)  # completed by token i + 2 (1-based)
    min_tokens = i + 1 + after
    s = default_model.engine.generate(ids, GenerateParams(max_tokens=N, ignore_eos=True, stop=(stop,),
                                                          min_tokens=min_tokens))
    full = tok.decode(g.token_ids)
    first = full.find(stop)
    if after == 0:
        assert (s.finish_reason, s.token_ids, s.text) == ("stop", g.token_ids[: i + 2], full[:first])
        return
    later = full.find(stop, first + 1)
    assert s.finish_reason == ("stop" if later >= 0 else "length") and len(s.token_ids) > i + 2
    assert s.text == (full[:later] if later >= 0 else full)


@pytest.mark.parametrize("prompt", ["请用一句话解释什么是机器学习。", "日本で一番高い山は何ですか？"])
def test_multibyte_generation_streams_without_split_characters(default_model, prompt):
    g = default_model.engine.generate(chat_ids(default_model, prompt), GenerateParams(max_tokens=16))
    tok = default_model.tokenizer
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in g.token_ids]
    assert "".join(pieces) == g.text == tok.decode(g.token_ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    assert any(ord(c) > 0x2E7F for c in g.text)  # the generation really has multi-byte characters


@pytest.mark.parametrize("include", [False, True])
def test_generation_cut_inside_a_character_ends_at_the_last_complete_one(default_model, include):
    """max_tokens reached inside a multi-byte character: the text leaves its bytes out (no U+FFFD), the
    tokens stay counted and in the log-probabilities; stop strings still match."""
    tok = default_model.tokenizer
    ids = chat_ids(default_model, "请用一句话解释什么是机器学习。")
    g = default_model.engine.generate(ids, GenerateParams(max_tokens=16, ignore_eos=True))
    k = max(k for k in range(2, 17) if tok.decode(g.token_ids[:k]).endswith("\ufffd"))  # a cut inside one
    params = dict(max_tokens=k, ignore_eos=True, logprobs=0, include_stop_str_in_output=include)
    c = default_model.engine.generate(ids, GenerateParams(**params))
    assert c.token_ids == g.token_ids[:k] and len(c.logprobs) == k and c.finish_reason == "length"
    full = tok.decode(c.token_ids)
    assert c.text == full[:-1] and not c.text.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(t) for t in c.token_ids) == c.text  # what was streamed, no more
    n = default_model.engine.generate(ids, GenerateParams(**params, stop=("never-there",)))
    assert (n.token_ids, n.finish_reason, n.text) == (c.token_ids, "length", c.text)
    clean = [tok.decode(c.token_ids[:j]) for j in range(1, k)]
    stop = next(t for t in reversed(clean) if len(t) >= 2 and not t.endswith("\ufffd"))[-2:]
    s = default_model.engine.generate(ids, GenerateParams(**params, stop=(stop,)))
    cut = full.find(stop)
    assert (s.finish_reason, s.stop_reason) == ("stop", stop)
    assert s.text == full[: cut + len(stop) if include else cut]
