"""EOS ids of pipeline.tokenizer.Tokenizer: the declared ids plus the chat template's end-of-turn token,
with small Hugging Face ``tokenizers`` objects and the real default-model tokenizer."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pipeline.gguf import read_gguf
from pipeline.resolve import resolve_model
from pipeline.tokenizer import Tokenizer

# <end_of_turn> comes before <eos> so that the declared EOS is not the smallest id.
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>",
           "<eos>"]
NOT_SPECIAL = ["<|end|>"]  # an added token that is not special
VOCAB = {t: i for i, t in enumerate(SPECIAL + NOT_SPECIAL + ["user", "assistant", "hello"])}

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
          "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")
NEWLINE_THEN_END = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n<|im_end|>{% endfor %}"
NO_END_TOKEN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PLAIN_END = "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"
AFTER_TEXT = "{% for m in messages %}{{ m['content'] }}.<|im_end|>{% endfor %}"
RAISES = "{{ raise_exception('conversations must start with a system turn') }}"
TYPE_ERROR = "{{ messages[0]['content'] + 1 }}"
CONTENT_REWRITTEN = "{% for m in messages %}{{ m['content'] | int | string }}<|im_end|>{% endfor %}"


def hf_tokenizer() -> HFTokenizer:
    hf = HFTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    return hf


def make(template, eos, bos=None) -> Tokenizer:
    return Tokenizer(hf_tokenizer(), bos_token_id=None if bos is None else VOCAB[bos],
                     eos_token_ids=[VOCAB[t] for t in eos], add_bos_token=False, chat_template=template)


# (template, declared EOS tokens, BOS token, expected EOS tokens)
CASES = [
    (CHATML, ["</s>"], "<s>", ["</s>", "<|im_end|>"]),
    (CHATML, ["<|im_end|>"], "<s>", ["<|im_end|>"]),
    (CHATML, [], None, ["<|im_end|>"]),
    (LLAMA3, ["<|end_of_text|>"], "<|begin_of_text|>", ["<|end_of_text|>", "<|eot_id|>"]),
    (GEMMA, ["<eos>"], "<bos>", ["<end_of_turn>", "<eos>"]),
    (LLAMA2, ["</s>"], "<s>", ["</s>"]),  # ' ' + eos_token: the declared EOS, after a space
    (NEWLINE_THEN_END, ["</s>"], None, ["</s>", "<|im_end|>"]),
    (NO_END_TOKEN, ["</s>"], None, ["</s>"]),
    (PLAIN_END, ["</s>"], None, ["</s>"]),  # <|end|> is an added token but not a special one
    (AFTER_TEXT, ["</s>"], None, ["</s>"]),  # text between the content and the special token
    (RAISES, ["</s>"], None, ["</s>"]),
    (TYPE_ERROR, ["</s>"], None, ["</s>"]),
    (CONTENT_REWRITTEN, ["</s>"], None, ["</s>"]),  # content | int is 0: no probe text to find
    (None, ["</s>"], None, ["</s>"]),
]


@pytest.mark.parametrize("template, eos, bos, expected", CASES)
def test_eos_ids_include_template_end_of_turn(template, eos, bos, expected):
    tok = make(template, eos, bos)
    assert tok.eos_token_ids == tuple(sorted(VOCAB[t] for t in expected))
    assert [tok._hf.id_to_token(i) for i in tok.eos_token_ids] == sorted(expected, key=VOCAB.get)


@pytest.mark.parametrize("template, eos, bos, expected", [c for c in CASES if c[1]])
def test_eos_token_stays_the_declared_one(template, eos, bos, expected):
    assert make(template, eos, bos).eos_token == eos[0]


def test_gemma_template_renders_declared_eos_token():
    tok = make(GEMMA, ["<eos>"], "<bos>")
    assert min(tok.eos_token_ids) == VOCAB["<end_of_turn>"]
    assert tok.eos_token == "<eos>"


def test_from_model_dir_adds_end_of_turn(tmp_path):
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3}))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.eos_token_ids == tuple(sorted([VOCAB["<|end_of_text|>"], VOCAB["<|eot_id|>"]]))
    assert tok.eos_token == "<|end_of_text|>"


def test_default_model_end_of_turn_is_its_eos():
    tok = read_gguf(resolve_model("smollm2-135m-instruct")).tokenizer
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    # The template alone gives the same id: <|im_end|> follows the assistant's content.
    bare = Tokenizer(tok._hf, bos_token_id=tok.bos_token_id, eos_token_ids=[], add_bos_token=False,
                     chat_template=tok.chat_template)
    assert bare.eos_token_ids == (2,)


def test_special_tokens_are_the_special_added_tokens_longest_first():
    tok = make(CHATML, ["</s>"])
    assert set(tok.special_tokens) == set(SPECIAL)
    assert "<|end|>" not in tok.special_tokens
    assert [len(t) for t in tok.special_tokens] == sorted((len(t) for t in SPECIAL), reverse=True)


@pytest.mark.parametrize("pre,flag,expected", [
    ("llama-bpe", None, True), ("llama3", None, True), ("llama-v3", None, True), ("llama-bpe", False, False),
    ("gpt2", None, False), ("gpt2", True, True),
])
def test_gguf_add_bos_defaults_as_llama_cpp(tmp_path, pre, flag, expected):
    """llama.cpp (src/llama-vocab.cpp) adds BOS after the Llama 3 pre-tokenizers unless
    tokenizer.ggml.add_bos_token says otherwise; a Llama 3 GGUF without the key ran without BOS."""
    from gguf_file import BOOL, BOS, STRING, write_tiny_gguf

    kv = {"tokenizer.ggml.pre": (STRING, pre)}
    if flag is not None:
        kv["tokenizer.ggml.add_bos_token"] = (BOOL, flag)
    tok = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", kv)).tokenizer
    assert tok.add_bos_token is expected
    assert (tok.encode("ab", add_bos=tok.add_bos_token)[0] == BOS) is expected
