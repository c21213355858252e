"""Structured output (``generation.structured``, ``pipeline.engine.structured``): on the real default model,
20 JSON schemas of increasing difficulty whose finished completions parse and validate with ``jsonschema``
(a validator no one here wrote), greedy output identical in sequential and batched decoding, a grammar or
choice of one string yielding exactly it, a regex; with a tiny random model (whose unmasked output is
noise, so only the mask can make it obey), every sampler setting, n, stop strings, min_tokens, logprobs,
the per-row column, bad values, resume and the fingerprint."""

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import json
import re

import jsonschema
import mlx.core as mx
import pytest
import yaml

from test_job_end_to_end import read_output, run_cli
from tiny_model import write_prompts, write_tiny_model

from pipeline.engine import BatchEngine, GenerateParams, Request
from pipeline.engine.request import Decoding
from pipeline.engine.structured import StructuredOutputsParams
from pipeline.errors import JobSpecError, RowError
from pipeline.jobspec import job_from_dict
from pipeline.run import run_job
from pipeline.shards import OutputError

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

# (what the prompt asks for, schema), simplest first.
SCHEMAS = [
    ("a yes or no answer", {"type": "boolean"}),
    ("a number of legs of a dog", {"type": "integer", "minimum": 0, "maximum": 10}),
    ("the name of a color", {"type": "string", "maxLength": 12}),
    ("a color", {"enum": ["red", "green", "blue"]}),
    ("a person", PERSON),
    ("a city", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "population": {"type": "integer", "minimum": 0}},
                "required": ["city"], "additionalProperties": False}),
    ("a temperature", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
                       "required": ["celsius"], "additionalProperties": False}),
    ("three fruits", {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3, "maxItems": 3}),
    ("one to two hobbies", {"type": "array", "items": {"enum": ["chess", "music", "sport"]}, "minItems": 1,
                            "maxItems": 2}),
    ("a phone number", {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                        "required": ["phone"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                "required": ["date"], "additionalProperties": False}),
    ("a product", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                                    "in_stock": {"type": "boolean"}},
                   "required": ["name", "price", "in_stock"], "additionalProperties": False}),
    ("a book with an optional subtitle", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20}, "subtitle": {"type": "string", "maxLength": 20}},
        "required": ["title"], "additionalProperties": False}),
    ("a person with an address", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("a team of two people", {"type": "object", "properties": {
        "team": {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}},
        "required": ["team"], "additionalProperties": False}),
    ("a task with a priority", {"type": "object", "properties": {
        "task": {"type": "string", "maxLength": 20}, "priority": {"enum": ["low", "medium", "high"]},
        "done": {"type": "boolean"}}, "required": ["task", "priority", "done"], "additionalProperties": False}),
    ("a point", {"$defs": {"coord": {"type": "integer", "minimum": -100, "maximum": 100}},
                 "type": "object", "properties": {"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a line between two points", {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("an answer or an error", {"anyOf": [
        {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
         "additionalProperties": False},
        {"type": "object", "properties": {"error": {"type": "string", "maxLength": 20}}, "required": ["error"],
         "additionalProperties": False}]}),
    ("a tree of two levels", {"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["label"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
]
MAX_TOKENS = 48
COMPACT = {"whitespace_flexible": False}  # llguidance's x-guidance option: no free whitespace (shorter values)


def _prompt(lm, text):
    return lm.tokenizer.encode(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Reply with JSON only: {text}."}]))


def _requests(lm):
    return [Request(i, _prompt(lm, what), GenerateParams(
        max_tokens=MAX_TOKENS, structured=StructuredOutputsParams(json={**schema, "x-guidance": COMPACT})))
        for i, (what, schema) in enumerate(SCHEMAS)]


@pytest.fixture(scope="module")
def schema_runs(default_model):
    lm = default_model
    reqs = _requests(lm)
    seq = {r.tag: lm.engine.generate(r.prompt_ids, r.params) for r in reqs}
    bat = dict(BatchEngine(lm.engine, 4, 256).run(reqs))
    return seq, bat, {r.tag: r.prompt_ids for r in reqs}


# Greedy sequential and batched runs share every token in float32 (the CPU's dtype); in float16 (the GPU's
# default) the two steps' logits differ by rounding, so the allowed tokens' best can flip where two are
# nearly tied: a first difference is excused only where the model's own logits (its forward over the
# prompt and the tokens before it) put the two tokens closer than this. Measured on an H200 (float16):
# one of 20 rows differed, at '":"' against '":' then '"' (the same text).
FLOAT16_NEAR_TIE = 0.1


def test_finished_completions_parse_and_validate(schema_runs):
    seq, _, _ = schema_runs
    stopped = [i for i, g in seq.items() if g.finish_reason == "stop"]
    for i in stopped:
        jsonschema.validate(json.loads(seq[i].text), SCHEMAS[i][1])
    for i, g in seq.items():
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "length":
            assert len(g.token_ids) == MAX_TOKENS
    print(f"{len(stopped)}/{len(SCHEMAS)} finished within {MAX_TOKENS} tokens")
    assert len(stopped) >= 15


def test_greedy_structured_output_is_the_same_batched(default_model, schema_runs):
    seq, bat, prompts = schema_runs
    assert bat.keys() == seq.keys()
    for i in seq:
        first = next((k for k, (a, b) in enumerate(zip(seq[i].token_ids, bat[i].token_ids)) if a != b), None)
        if first is None:
            assert bat[i].token_ids == seq[i].token_ids, (i, seq[i].text, bat[i].text)
            assert bat[i].finish_reason == seq[i].finish_reason
            continue
        model = default_model.model
        logits = model(mx.array(prompts[i] + seq[i].token_ids[:first])[None], model.make_cache())[0, -1]
        assert logits.dtype != mx.float32, (i, first, seq[i].text, bat[i].text)  # float32: no tie excused
        a, b = seq[i].token_ids[first], bat[i].token_ids[first]
        gap = abs(logits[a].item() - logits[b].item())
        assert gap < FLOAT16_NEAR_TIE, (i, first, a, b, gap)


@pytest.mark.parametrize("structured", [StructuredOutputsParams(choice=("Paris, France",)),
                                        StructuredOutputsParams(grammar='start: "The answer is 42."')])
def test_a_grammar_of_one_string_yields_exactly_it(default_model, structured):
    lm = default_model
    prompt = _prompt(lm, "say anything")
    for params in (GenerateParams(max_tokens=20, structured=structured),
                   GenerateParams(max_tokens=20, temperature=1.0, seed=5, structured=structured)):
        seq = lm.engine.generate(prompt, params)
        (_, bat), = BatchEngine(lm.engine, 2, 256).run([Request(0, prompt, params)])
        expected = structured.choice[0] if structured.choice else "The answer is 42."
        for g in (seq, bat):
            assert (g.text, g.finish_reason) == (expected, "stop")


def test_regex_on_the_real_model(default_model):
    lm = default_model
    params = GenerateParams(max_tokens=16, structured=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    g = lm.engine.generate(_prompt(lm, "a phone number"), params)
    assert g.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", g.text)


# --- every sampler setting, on a tiny random model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pipeline import load_model

    tmp = tmp_path_factory.mktemp("tiny")
    return load_model(path=write_tiny_model(tmp / "tiny"))


SETTINGS = [dict(), dict(temperature=1.0), dict(temperature=0.9, top_p=0.8), dict(temperature=1.2, top_k=5),
            dict(temperature=1.0, min_p=0.1), dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
            dict(temperature=1.0, repetition_penalty=1.2), dict(min_tokens=3), dict(logprobs=2, temperature=1.0)]
WORD = r"(cat|dog|bird)( (cat|dog|bird)){1,3}"


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "greedy")
def test_every_sampler_setting_obeys_the_mask(tiny, settings):
    """The random model's own choice would almost never be in the grammar: only the mask makes it obey. Each
    sample is checked in sequential and batched decoding (3 slots, with an unconstrained neighbour)."""
    eng = tiny.engine
    structured = StructuredOutputsParams(regex=WORD)
    reqs = [Request(k, eng.tokenizer.encode(f"prompt {k}"), GenerateParams(max_tokens=24, seed=k, structured=structured,
                                                                          **settings)) for k in range(4)]
    free = Request("free", eng.tokenizer.encode("free"), GenerateParams(max_tokens=24, **settings))
    seq = {r.tag: eng.generate(r.prompt_ids, r.params) for r in reqs}
    bat = dict(BatchEngine(eng, 3, 256).run(reqs + [free]))
    for g in [*seq.values(), *(bat[r.tag] for r in reqs)]:
        assert g.finish_reason == "stop" and re.fullmatch(WORD, g.text), g.text
        if "logprobs" in settings:
            assert len(g.logprobs) == len(g.token_ids) and all(len(t) == 2 for t in g.top_token_ids)


# --- the mask on the device ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [96, 100, 130], ids=lambda v: f"vocab{v}")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_token_mask_allows_exactly_its_bits(vocab, dtype):
    """``TokenMask.apply`` against numpy's own unpacking of the words (little-endian bits): a logit is kept,
    as float32, where its bit is set and is -inf elsewhere, and ids past the words' 32 * 3 are never kept.
    On MLX's CUDA backend the kernel (``cuda.mask``) and the MLX ops both run and give the same array."""
    import mlx.core as mx
    import numpy as np

    from pipeline.engine.cuda import mask as kernel
    from pipeline.engine.structured import allowed_tokens

    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(5, 3), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    keep = np.zeros((5, vocab), dtype=bool)
    keep[:, : min(vocab, 96)] = bits[:, :vocab]
    x = mx.array(logits).astype(getattr(mx, dtype))
    want = np.where(keep, np.array(x.astype(mx.float32)), -np.inf)
    mask = allowed_tokens(bitmask, vocab)
    assert np.array_equal(np.array(mask.words), bitmask.view(np.uint32))
    assert np.array_equal(np.array(mask.bools()), keep)
    for enabled in (True, False):
        kernel.ENABLED = enabled
        try:
            got = mask.apply(x)
            assert got.dtype == mx.float32 and np.array_equal(np.array(got), want), enabled
        finally:
            kernel.ENABLED = True


def test_a_packed_bitmask_is_its_rows():
    """``pack`` keeps a bitmask's distinct rows and where each row went, exactly: rows equal on the sampled words
    but not elsewhere stay apart; the ``TokenMask`` built from the packed upload holds the bitmask's own words."""
    import numpy as np

    from pipeline.engine.structured import allowed_tokens, pack

    rng = np.random.default_rng(1)
    distinct = rng.integers(-2**31, 2**31 - 1, size=(4, 1536), dtype=np.int64).astype(np.int32)
    bitmask = distinct[[0, 1, 1, 2, 0, 3, 3, 3, 2]].copy()
    bitmask[6, 5] ^= 1  # word 5 is not sampled (every 24th is): equal to row 5 there, not here
    bitmask[7, 24] ^= 1  # word 24 is
    rows, inverse = pack(bitmask)
    assert np.array_equal(rows[inverse], bitmask) and inverse.dtype == np.int32
    assert len(rows) == 6 == len({r.tobytes() for r in bitmask})
    mask = allowed_tokens(bitmask, 1536 * 32)
    assert np.array_equal(np.array(mask.words), bitmask.view(np.uint32))
    one = allowed_tokens(bitmask[:1], 1536 * 32)
    assert np.array_equal(np.array(one.words), bitmask[:1].view(np.uint32))


@pytest.mark.parametrize("load_min_bytes", [0, 1 << 62])
def test_a_bitmask_uploads_the_same_words_by_either_copy(monkeypatch, load_min_bytes):
    """``device_words`` gives the bitmask's own words whether it takes the ``mx.load`` copy (``LOAD_MIN_BYTES`` 0:
    every bitmask) or ``mx.array`` (a limit no bitmask reaches); on the CPU both are ``mx.array``, on MLX's CUDA
    backend each runs its own copy."""
    import numpy as np

    from pipeline.engine import structured as st

    monkeypatch.setattr(st, "LOAD_MIN_BYTES", load_min_bytes)
    rng = np.random.default_rng(load_min_bytes % 7)
    for rows in (1, 3, 64):
        bitmask = rng.integers(-2**31, 2**31 - 1, size=(rows, 1536), dtype=np.int64).astype(np.int32)
        words = st.device_words(bitmask)
        assert words.dtype == mx.uint32 and np.array_equal(np.array(words), bitmask.view(np.uint32))


def test_matcher_families_change_no_output(tiny, monkeypatch):
    """Matchers copied from several fresh matchers of their grammar (``MATCHER_FAMILIES``, each family its own
    lexer) give the tokens one family gives, sampled or greedy, and the batched calls list them family by family."""
    from pipeline.engine import structured as st

    eng = tiny.engine
    reqs = [Request(k, eng.tokenizer.encode(f"prompt {k}"), GenerateParams(
        max_tokens=16, seed=k, temperature=1.0 if k % 2 else 0.0, structured=StructuredOutputsParams(regex=WORD)))
        for k in range(6)]
    runs = {}
    for families in (1, 3):
        monkeypatch.setattr(st, "MATCHER_FAMILIES", families)
        out = dict(BatchEngine(eng, 4, 256).run(reqs))
        assert not [g for g in out.values() if isinstance(g, RowError)], out
        runs[families] = {tag: g.token_ids for tag, g in out.items()}
    assert runs[3] == runs[1]
    slots = [Decoding(eng, r.prompt_ids, r.params, capacity=256) for r in reqs]
    assert sorted({d.constraint.family for d in slots}) == [0, 1, 2]
    tok = st.ll_tokenizer(eng.tokenizer, tuple(sorted(eng.eos_token_ids)))
    grammar = StructuredOutputsParams(regex=WORD).lark()
    assert len({id(st._fresh_matcher(grammar, tok, f)) for f in range(3)}) == 3  # three lexers, not one
    order = [c.family for c, _ in st._constraints(slots)]
    assert order == sorted(order) and sorted(b for _, b in st._constraints(slots)) == list(range(6))


def test_the_worker_reads_the_steps_tokens_and_changes_no_output(tiny, monkeypatch):
    """With ``BatchEngine.worker_reads`` the masks' worker gets each step's tokens as a device array (the host does
    not wait for them before it launches the next forward) and the run gives the tokens of the order where the host
    reads them first, sampled or greedy, with slots refilled mid-run and a stop id that ends a row."""
    from pipeline.engine.structured import SlotMasks

    eng = tiny.engine
    stop = eng.tokenizer.encode(" a")[-1]
    reqs = [Request(k, eng.tokenizer.encode(f"prompt {k}"), GenerateParams(
        max_tokens=6 + 3 * k, seed=k, temperature=1.0 if k % 2 else 0.0, stop_token_ids=[stop] if k == 2 else (),
        structured=StructuredOutputsParams(regex=WORD) if k != 3 else None)) for k in range(7)]
    given = []
    start = SlotMasks.start

    def recording_start(self, slots, tokens):
        given.append(type(tokens))
        return start(self, slots, tokens)

    monkeypatch.setattr(SlotMasks, "start", recording_start)
    runs = {}
    for worker in (False, True):
        monkeypatch.setattr(BatchEngine, "worker_reads", worker)
        given.clear()
        out = dict(BatchEngine(eng, 3, 256).run(reqs))
        assert sorted(out) == list(range(7)) and not [g for g in out.values() if isinstance(g, RowError)], out
        runs[worker] = {tag: (g.token_ids, g.finish_reason) for tag, g in out.items()}
        assert given and set(given) == ({mx.array} if worker else {list})
    assert runs[True] == runs[False]


def test_a_batch_with_constraints_lowers_the_switch_interval_and_restores_it(tiny):
    """``SlotMasks`` lowers Python's switch interval while its worker runs (so the worker gets the GIL back
    soon after each llguidance call) and puts the old one back when the run ends."""
    import sys

    from pipeline.engine.structured import SlotMasks

    eng = tiny.engine
    before = sys.getswitchinterval()
    reqs = [Request(k, eng.tokenizer.encode(f"prompt {k}"), GenerateParams(
        max_tokens=8, structured=StructuredOutputsParams(regex=WORD))) for k in range(3)]
    seen = []
    for _ in BatchEngine(eng, 2, 256).run(reqs):
        seen.append(sys.getswitchinterval())
    lowered = pytest.approx(SlotMasks.SWITCH_INTERVAL)
    assert before > SlotMasks.SWITCH_INTERVAL and seen and all(v == lowered for v in seen)
    assert sys.getswitchinterval() == before
    run = BatchEngine(eng, 2, 256).run(reqs)
    next(run)
    assert sys.getswitchinterval() == lowered
    run.close()  # a caller that stops early
    assert sys.getswitchinterval() == before


def test_eos_only_where_the_grammar_accepts_and_length_when_cut(tiny):
    eng = tiny.engine
    cut = eng.generate(eng.tokenizer.encode("x"), GenerateParams(
        max_tokens=3, structured=StructuredOutputsParams(regex="[a-z]{60}")))
    assert cut.finish_reason == "length" and re.fullmatch("[a-z]+", cut.text) and len(cut.token_ids) == 3
    whole = eng.generate(eng.tokenizer.encode("x"), GenerateParams(
        max_tokens=12, temperature=1.0, structured=StructuredOutputsParams(regex="[a-z]{6}")))
    assert whole.finish_reason == "stop" and re.fullmatch("[a-z]{6}", whole.text)


def test_ignore_eos_runs_a_value_that_may_go_on_to_max_tokens(tiny):
    """``ignore_eos``: EOS is not offered where the value may end but go on (each word here), so every row runs
    to max_tokens, its text in the grammar and no EOS among its tokens (vLLM's ignore_eos); sequential and
    batched. A value that cannot go on still ends "stop"."""
    eng = tiny.engine
    structured = StructuredOutputsParams(regex=WORD.replace("{1,3}", "*"))
    reqs = [Request(k, eng.tokenizer.encode(f"p {k}"), GenerateParams(
        max_tokens=24, seed=k, temperature=1.0, ignore_eos=True, structured=structured)) for k in range(4)]
    outs = [eng.generate(r.prompt_ids, r.params) for r in reqs] + [g for _, g in BatchEngine(eng, 3, 256).run(reqs)]
    for g in outs:
        assert g.finish_reason == "length" and len(g.token_ids) == 24, (g.finish_reason, g.text)
        *words, last = g.text.split(" ")  # cut by max_tokens: the last word may be part of one
        assert all(w in ("cat", "dog", "bird") for w in words) and any(w.startswith(last) for w in ("cat", "dog", "bird")), g.text
        assert not set(g.token_ids) & set(eng.eos_token_ids), g.token_ids
    whole = eng.generate(eng.tokenizer.encode("x"), GenerateParams(
        max_tokens=12, temperature=1.0, ignore_eos=True, structured=StructuredOutputsParams(regex="[a-z]{6}")))
    assert whole.finish_reason == "stop" and re.fullmatch("[a-z]{6}", whole.text)
    assert not set(whole.token_ids) & set(eng.eos_token_ids)


def test_stop_token_ids_that_are_all_the_grammar_allows_end_the_row(tiny):
    """The grammar allows only letters, every letter is a stop id and the value may not end yet: the stop ids
    stay allowed (not an empty mask, which sampled token 0 and failed the row with llguidance's dump), and the
    one sampled ends the row as a stop id does without a grammar; sequential and batched."""
    eng = tiny.engine
    letters = sorted({eng.tokenizer.encode(c)[0] for c in "abcdefghijklmnopqrstuvwxyz"})
    params = GenerateParams(max_tokens=8, stop_token_ids=letters, structured=StructuredOutputsParams(regex="[a-z]"))
    seq = eng.generate(eng.tokenizer.encode("x"), params)
    [(_, bat)] = BatchEngine(eng, 2, 256).run([Request(0, eng.tokenizer.encode("x"), params)])
    for g in (seq, bat):
        assert (g.finish_reason, g.text, g.token_ids) == ("stop", "", []) and g.stop_token_id in letters, g


def test_a_stop_string_cuts_a_structured_value(tiny):
    eng = tiny.engine
    g = eng.generate(eng.tokenizer.encode("x"), GenerateParams(
        max_tokens=12, stop=[" "], structured=StructuredOutputsParams(choice=("cat dog bird",))))
    assert (g.text, g.finish_reason, g.stop_reason) == ("cat", "stop", " ")


def test_structured_output_needs_a_tokenizer_and_a_compiling_grammar(tiny):
    from pipeline.engine import Engine

    bare = Engine(tiny.engine.model, tiny.engine.eos_token_ids, tiny.engine.context_length)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate([1, 2], GenerateParams(structured=StructuredOutputsParams(regex="a")))
    with pytest.raises(RowError, match=r"structured\.regex"):
        tiny.engine.generate([1, 2], GenerateParams(structured=StructuredOutputsParams(regex="a(")))


# --- the job key ------------------------------------------------------------------------------------------


def _job(structured=None, **inp):
    return {"input": {"path": "in.parquet", **inp}, "output": {"dir": "out"},
            "generation": {} if structured is None else {"structured": structured}}


@pytest.mark.parametrize("structured, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, "generation.structured.json: "),
    ({"json": {"type": "string", "pattern": "a("}}, "generation.structured.json: "),
    ({"regex": "[0-9"}, "generation.structured.regex: invalid regex \"[0-9\""),  # no position in llguidance's wrapper
    ({"grammar": "start: foo ("}, "generation.structured.grammar: "),
    ({"choice": []}, "generation.structured.choice must be a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "set exactly one of json, json_object: true, regex, choice, grammar"),
    ({}, "set exactly one of"),
    ({"json_object": False}, "(got none)"),
    ({"json": "no/such/schema.json"}, "generation.structured.json: cannot read schema file"),
    ({"regexp": "a"}, "unknown key 'generation.structured.regexp' (did you mean 'regex'?)"),
])
def test_an_invalid_job_key_is_one_line_naming_it(structured, message):
    with pytest.raises(JobSpecError) as e:
        job_from_dict(_job(structured))
    assert all("\n" not in p for p in e.value.problems)
    assert message in e.value.problems[0]
    assert len(e.value.problems) == (2 if "unknown key" in message else 1)  # + "set exactly one" for a typo


@pytest.mark.parametrize("structured, message", [
    ({"choice": [1, 2]}, "generation.structured.choice must be a non-empty list of non-empty strings, got list [1, 2]"),
    ({"json": 5}, "generation.structured.json must be a JSON Schema (a mapping) or the path of a .json file holding "
                  "one, got int 5"),
    ({"regex": 5}, "generation.structured.regex must be a string, got int 5"),
    ({"grammar": ["x"]}, "generation.structured.grammar must be a string, got list ['x']"),
    ({"json_object": "yes"}, "generation.structured.json_object must be true or false, got str 'yes'"),
    ({"json_object": 0}, "generation.structured.json_object must be true or false, got int 0"),
])
def test_a_value_of_the_wrong_type_is_one_problem(structured, message):
    """A key given a value of the wrong type is that one problem, not also "set exactly one of ... (got none)"."""
    with pytest.raises(JobSpecError) as e:
        job_from_dict(_job(structured))
    assert e.value.problems == [message]


CELL = "input.structured_column 'format' of row 'r9'"


@pytest.mark.parametrize("cell, message", [
    ('{"regex": "a", "extra": 1}', "unknown key 'extra' (known: json, json_object, regex, choice, grammar)"),
    ('{"regexp": "a"}', "unknown key 'regexp' (did you mean 'regex'?); set exactly one of json, json_object: true, "
                        "regex, choice, grammar (got none)"),
    ('{"regex": 5}', "regex must be a string, got int 5"),
    ('{"choice": [1, 2]}', "choice must be a non-empty list of non-empty strings, got list [1, 2]"),
    ('{"json": 5}', "json must be a JSON Schema (a mapping) or the path of a .json file holding one, got int 5"),
    ('{"regex": "[0-9"}', 'regex: invalid regex "[0-9"'),
    ("{}", "set exactly one of json, json_object: true, regex, choice, grammar (got none)"),
    ('{"regex": "a", "choice": ["a"]}', "set exactly one of json, json_object: true, regex, choice, grammar "
                                        "(got regex, choice)"),
    ("[1]", 'must be a JSON object such as {"regex": "..."}, got list'),
    ("{not json", "is not JSON: "),
])
def test_a_bad_cell_is_one_line_naming_the_row_then_each_problem_once(cell, message):
    from pipeline.jobspec import structured_from_cell

    with pytest.raises(JobSpecError) as e:
        structured_from_cell(cell, CELL)
    assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0]
    assert e.value.problems[0].startswith(f"{CELL}: {message}")
    assert e.value.problems[0].count(CELL) == 1


def test_a_good_cell():
    from pipeline.jobspec import structured_from_cell

    assert structured_from_cell('{"choice": "only"}', CELL) == StructuredOutputsParams(choice=("only",))
    assert structured_from_cell('{"json_object": true}', CELL).key == "json_object"


def test_the_cli_refuses_an_invalid_key_before_loading_the_model(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job({"regex": "(unclosed"})), encoding="utf-8")
    for cmd in ("validate", "run"):
        proc = run_cli(cmd, str(job), expect=2)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "generation.structured.regex" in lines[0]
        assert "loading" not in proc.stderr


def test_a_schema_file_is_read_into_the_fingerprint(tmp_path, monkeypatch):
    from pipeline.run.plan import fingerprint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "person.json").write_text(json.dumps(PERSON), encoding="utf-8")
    by_path = job_from_dict(_job({"json": "person.json"}))
    inline = job_from_dict(_job({"json": PERSON}))
    assert by_path.generation.structured.json == PERSON
    assert fingerprint(by_path, {}) == fingerprint(inline, {})
    assert fingerprint(inline, {})["generation"]["structured"] == {"json": PERSON}
    other = job_from_dict(_job({"json": {**PERSON, "required": ["name"]}}))
    assert fingerprint(other, {}) != fingerprint(inline, {})
    plain = fingerprint(job_from_dict(_job()), {})
    assert "structured" not in plain["generation"] and "structured_column" not in plain["prompt"]


# --- jobs: the per-row column, resume -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_job_files(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("jobs")
    model = write_tiny_model(tmp / "tiny")
    formats = [json.dumps({"regex": "[0-9]{4}"}), None, json.dumps({"choice": ["alpha", "beta"]}),
               "{not json", json.dumps({"regex": "[0-9"}), json.dumps({"json": {"enum": ["x", "y"]}})]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"row {i}" for i in range(6)],
                             "format": formats}), tmp / "in.parquet")
    write_prompts(tmp / "plain.parquet", 6)
    return tmp, model


def _tiny_job(tmp, model, out, **extra):
    job = {"model": str(model), "input": {"path": str(tmp / "in.parquet"), "id_column": "id",
                                          "structured_column": "format"},
           "generation": {"max_tokens": 8, "structured": {"regex": "[a-z]{3}"}},
           "output": {"dir": str(tmp / out), "shard_size": 2}}
    for section, values in extra.items():
        job[section] = {**job.get(section, {}), **values}
    return job_from_dict(job)


def test_the_per_row_column(tiny_job_files):
    tmp, model = tiny_job_files
    run_job(_tiny_job(tmp, model, "rows"), progress=False, echo=lambda *a: None)
    rows = {r["id"]: r for r in read_output(tmp / "rows").to_pylist()}
    assert re.fullmatch("[0-9]{4}", rows["r0"]["completion"]) and rows["r0"]["finish_reason"] == "stop"
    assert re.fullmatch("[a-z]{3}", rows["r1"]["completion"])  # null: the job's own constraint
    assert rows["r2"]["completion"] in ("alpha", "beta")
    assert rows["r5"]["completion"] in ('"x"', '"y"')
    for rid, why in (("r3", "is not JSON"), ("r4", "regex")):
        err = rows[rid]["error"]
        assert rows[rid]["completion"] is None and "\n" not in err
        assert err.startswith(f"input.structured_column 'format' of row '{rid}'") and why in err


def test_resume_continues_and_a_changed_schema_is_refused(tiny_job_files):
    tmp, model = tiny_job_files
    job = _tiny_job(tmp, model, "resume", input={"path": str(tmp / "plain.parquet"), "structured_column": None})
    whole = _tiny_job(tmp, model, "whole", input={"path": str(tmp / "plain.parquet"), "structured_column": None})
    quiet = dict(progress=False, echo=lambda *a: None)
    run_job(job, limit=3, **quiet)
    first = read_output(tmp / "resume").to_pylist()
    run_job(job, **quiet)
    run_job(whole, **quiet)
    resumed = {r["id"]: r["completion"] for r in read_output(tmp / "resume").to_pylist()}
    assert resumed == {r["id"]: r["completion"] for r in read_output(tmp / "whole").to_pylist()}
    assert len(resumed) == 6 and all(re.fullmatch("[a-z]{3}", c) for c in resumed.values())
    assert all(resumed[r["id"]] == r["completion"] for r in first)
    changed = _tiny_job(tmp, model, "resume", input={"path": str(tmp / "plain.parquet"), "structured_column": None},
                        generation={"structured": {"regex": "[a-z]{4}"}})
    with pytest.raises(OutputError, match="structured"):
        run_job(changed, **quiet)


def test_n_samples_and_seeds(tiny_job_files):
    tmp, model = tiny_job_files
    job = _tiny_job(tmp, model, "n", input={"path": str(tmp / "plain.parquet"), "structured_column": None},
                    generation={"n": 3, "temperature": 1.0, "seed": 7})
    run_job(job, progress=False, echo=lambda *a: None)
    rows = read_output(tmp / "n").to_pylist()
    assert len(rows) == 18 and all(re.fullmatch("[a-z]{3}", r["completion"]) for r in rows)
    assert len({r["completion"] for r in rows}) > 6  # samples differ: each has its own seed


PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9},
                                        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
       "required": ["pet", "legs"], "additionalProperties": False, "x-guidance": COMPACT}


def test_export_json_fields_keeps_every_row(tiny_job_files, tmp_path):
    """Rows whose completion is a JSON object get its fields as columns (the schema's, in its order); a failed
    row, a completion that is not an object, keep their row with null fields and a json_error."""
    import pyarrow.parquet as pq

    tmp, model = tiny_job_files
    run_job(_tiny_job(tmp, model, "export", generation={"max_tokens": 24, "structured": {"json": PET}}),
            progress=False, echo=lambda *a: None)
    run_cli("export", str(tmp / "export"), "--to", str(tmp_path / "flat.parquet"), "--json-fields")
    table = pq.read_table(tmp_path / "flat.parquet")
    assert table.num_rows == 6 and table.column_names[-4:] == ["pet", "legs", "tags", "json_error"]
    assert str(table.schema.field("legs").type) == "int64" and str(table.schema.field("tags").type) == "string"
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["r2"]["json_error"].startswith("not JSON: ") and rows["r2"]["pet"] is None  # choice alpha / beta
    assert rows["r5"]["json_error"] == "not a JSON object: str" and rows["r5"]["legs"] is None  # enum "x" / "y"
    assert rows["r3"]["json_error"] == "no completion" and rows["r3"]["error"] is not None
    parsed = [r for r in rows.values() if r["json_error"] is None]
    assert parsed and all(r["finish_reason"] == "stop" for r in parsed)
    for r in parsed:
        value = json.loads(r["completion"])
        jsonschema.validate(value, PET)
        assert (r["pet"], r["legs"]) == (value["pet"], value["legs"])
        assert r["tags"] == (json.dumps(value["tags"]) if "tags" in value else None)


def test_json_fields_named_like_a_column_get_unique_names(tmp_path):
    """Fields named like a results column or ``json_error`` (the export's own column) get ``json_``
    prefixes until unique: the table has no repeated name, and it is written and read back (Parquet and
    JSONL; a repeated name made Parquet unreadable and JSONL fail)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.export import _write, json_columns

    records = [{"ok": True, "error": "none", "json_error": "x", "json_json_error": 1, "id": 7}, {"ok": False}]
    table = pa.table({"id": ["a", "b"], "completion": [json.dumps(r) for r in records],
                      "error": pa.array([None, None], pa.string())})
    out = json_columns(table, {"properties": {"error": {"type": "string"}, "extra": {}}})
    assert out.column_names == ["id", "completion", "error", "ok", "json_json_error", "json_json_json_error",
                                "json_json_json_json_error", "json_id", "extra", "json_error"]
    rows = out.to_pylist()
    assert rows[0]["json_json_error"] == "none" and rows[0]["json_json_json_error"] == "x"
    assert rows[0]["json_json_json_json_error"] == 1 and rows[0]["json_id"] == 7 and rows[0]["id"] == "a"
    assert [r["json_error"] for r in rows] == [None, None] and rows[1]["json_json_error"] is None
    _write(out, "parquet", tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet").to_pylist() == rows
    _write(out, "jsonl", tmp_path / "t.jsonl")
    assert [json.loads(line)["json_json_error"] for line in (tmp_path / "t.jsonl").read_text().splitlines()] == [
        "none", None]


def test_json_fields_a_completion_that_is_null_is_not_an_object():
    """A completion ``null`` parses (to None) but is no object: its json_error says so, as ``[]``'s does (it
    counted as parsed, json_error null)."""
    import pyarrow as pa

    from pipeline.export import json_columns

    table = pa.table({"completion": ["null", "[]", '{"a": 1}', None]})
    assert json_columns(table).select(["a", "json_error"]).to_pylist() == [
        {"a": None, "json_error": "not a JSON object: null"}, {"a": None, "json_error": "not a JSON object: list"},
        {"a": 1, "json_error": None}, {"a": None, "json_error": "no completion"}]


def test_json_fields_keep_every_number_exact():
    """Integers beside floats are float64 while each is exactly a float64; one beyond 2**53 that is not (it was
    cast, 9007199254740993 became ...992) makes the field JSON text, as an integer beyond int64 does."""
    import pyarrow as pa

    from pipeline.export import json_columns

    big = 2**53 + 1
    records = [{"a": 1, "b": big, "c": 2**64, "d": 2**53}, {"a": 0.5, "b": 0.5, "c": 1, "d": 0.5}, {}]
    out = json_columns(pa.table({"completion": [json.dumps(r) for r in records]}))
    assert {f.name: str(f.type) for f in out.schema} == {"completion": "string", "a": "double", "b": "string",
                                                       "c": "string", "d": "double", "json_error": "string"}
    assert out.column("a").to_pylist() == [1.0, 0.5, None] and out.column("d").to_pylist() == [2**53, 0.5, None]
    assert out.column("b").to_pylist() == [str(big), "0.5", None]
    assert out.column("c").to_pylist() == [str(2**64), "1", None]


def test_warm_up_traces_the_constrained_step(tmp_path):
    """A structured job's warm-up traces the forward-only step its constrained rows decode with (compiled
    where the machine compiles), so the first row traces nothing."""
    from pipeline import load_model

    lm = load_model(path=write_tiny_model(tmp_path / "tiny"))
    lm.warm_up(structured=True)
    traces = lm.engine.trace_count
    g = lm.engine.generate([1, 2, 3], GenerateParams(max_tokens=6, structured=StructuredOutputsParams(regex="[a-z]+")))
    assert lm.engine.trace_count == traces
    assert g.compiled == lm.engine.compile


def test_a_rejected_tokens_error_leaves_out_the_matchers_dump():
    from pipeline.engine.structured import one_line

    dump = ('Parser Error: token "\\x00" doesn\'t satisfy the grammar; byte \'y\' fails parse <state> Tokens: x\n'
            'Stop: ParserTooComplex </state><grammar> {"grammars": []} </grammar>')
    assert one_line(dump) == 'Parser Error: token "\\x00" doesn\'t satisfy the grammar; byte \'y\' fails parse'


def test_json_fields_refuse_nan_infinity_and_numbers_beyond_float64():
    """Python's parser takes ``NaN`` / ``Infinity`` (not JSON, RFC 8259) and reads ``1e400`` as inf, which no JSON
    writer gives back: each such record gets its ``json_error``, the others parse."""
    import pyarrow as pa

    from pipeline.export import json_columns

    texts = ['{"a": NaN}', '{"a": -Infinity}', '{"a": 1e400}', '{"a": 1.5e300}']
    out = json_columns(pa.table({"completion": texts}))
    errors = out.column("json_error").to_pylist()
    assert errors[:3] == ["not JSON: NaN is not a JSON value (RFC 8259 has no NaN or Infinity)",
                          "not JSON: -Infinity is not a JSON value (RFC 8259 has no NaN or Infinity)",
                          "not JSON: the number 1e400 is beyond float64"]
    assert errors[3] is None and out.column("a").to_pylist() == [None, None, None, 1.5e300]
