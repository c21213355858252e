"""Prefix caching (``pipeline.engine.prefix``, ``Engine.prefill_prompt``): a row that reuses KV of earlier rows
equals, bitwise on the CPU, the same row prefilled by an engine that has nothing to reuse (tokens and
logprobs), for prompts sharing no block, one block, many blocks, a prompt ending on a block edge, a repeated
prompt (``n`` > 1), under eviction, in batched mode, with quantized and rotating caches; and the reuse is
real (the prompt tokens the engine computes drop by what ``cached_prompt_tokens`` says)."""

from __future__ import annotations

import pipeline  # noqa: F401  (loads OpenBLAS before mlx.core, as in real runs)

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from pipeline.engine import Engine, GenerateParams
from pipeline.engine.batch import BatchEngine, Request
from pipeline.engine.prefix import PrefixStore, block_hashes
from pipeline.jobspec import CacheSpec
from pipeline.models.llama import Model, ModelArgs

CONFIG = {
    "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}
B = 16  # prefix_block_size in these tests
GREEDY = GenerateParams(max_tokens=6, logprobs=2)
SAMPLED = GenerateParams(max_tokens=6, temperature=0.9, seed=5, logprobs=0)


@pytest.fixture(scope="module")
def model():
    """A random-weight llama, head_dim 32 (so kv_group_size 32 works), projections scaled up 4x as in
    tests/test_engine.py (otherwise greedy decoding repeats one token)."""
    mx.random.seed(1)
    m = Model(ModelArgs.from_dict(CONFIG))
    m.update(tree_unflatten([(k, v * 4) for k, v in tree_flatten(m.parameters()) if k.endswith("proj.weight")]))
    m.eval()
    mx.eval(m.parameters())
    return m


KINDS = {
    "full": {},
    "quantized": {"kv_bits": 4, "kv_group_size": 32},
    "rotating": {"max_kv_size": 256},
    "rotating-quantized": {"max_kv_size": 256, "kv_bits": 8, "kv_group_size": 32},
}


def engine(model, gb: float = 1.0, exact: bool = True, **cache) -> Engine:
    spec = CacheSpec(prefix_cache_gb=gb, prefix_block_size=B, **cache)
    return Engine(model, [0], 512, cache_spec=spec, compile=False, exact_prefix=exact)


def ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 96, n)]


SHARED = ids(0, 100)  # 6 full blocks and 4 tokens
PROMPTS = [
    SHARED + ids(1, 20),           # nothing cached yet
    ids(2, 40),                    # shares no block
    SHARED[:20] + ids(3, 30),      # shares one block (16 of 20 shared tokens)
    SHARED + ids(4, 7),            # shares 6 blocks
    SHARED[:64],                   # ends on a block edge, all 4 blocks cached: the last one is recomputed
    SHARED[:64],                   # the same prompt again (a row's next sample): nothing recomputed
]
CACHED = [0, 0, 16, 96, 48, 64]


def same(a, b) -> None:
    """Two generations equal bitwise: tokens, chosen logprobs, top ids and top logprobs."""
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    assert a.top_token_ids == b.top_token_ids and a.top_logprobs == b.top_logprobs


def test_block_keys_chain_over_everything_before():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and len(set(a)) == 2 and all(len(k) == 32 for k in a)
    assert block_hashes(list(range(32)), 16) == a  # the tail after the last full block has no key
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # block 1's ids are equal; its key covers block 0 too
    assert block_hashes(list(range(15)), 16) == []


def _block(nbytes: int):
    return [(mx.zeros((nbytes // 8,), mx.float32), mx.zeros((nbytes // 8,), mx.float32))]


def test_store_evicts_least_recently_used_and_a_chain_tail_first():
    store = PrefixStore(capacity_bytes=3 * 64, block_size=16)
    for key in (b"a0", b"a1", b"a2"):
        store.put(key, _block(64))
    assert len(store) == 3 and store.nbytes == 192
    assert len(store.take([b"a0", b"a1", b"a2"])) == 3  # touched a2, a1, a0: a0 most recent
    store.put(b"b0", _block(64))
    assert b"a2" not in store and store.hits([b"a0", b"a1", b"a2"]) == 2 and store.evictions == 1
    store.put(b"big", _block(256))  # larger than the whole store: not held, nothing evicted
    assert b"big" not in store and len(store) == 3 and store.nbytes <= store.capacity_bytes
    assert store.hits([b"x", b"a0"]) == 0


def test_store_finds_the_longest_partial_block_after_a_parent():
    store = PrefixStore(capacity_bytes=3 * 64, block_size=4)
    store.put(b"p", _block(64), parent=b"", ids=[1, 2, 3, 4])
    store.put(b"q", _block(64), parent=b"", ids=[1, 2, 7, 8])
    store.put(b"r", _block(64), parent=b"p", ids=[5, 6, 7, 8])
    assert store.partial(b"", [1, 2, 7, 9]) == (b"q", 3)
    assert store.partial(b"", [1, 2, 9]) == (b"p", 2)  # a tie: the oldest
    assert store.partial(b"p", [5, 6, 7, 8, 9]) == (b"r", 4)
    assert store.partial(b"", [9, 2]) == (b"", 0) and store.partial(b"other", [1]) == (b"", 0)
    assert (store.common(b"q", [1, 2, 7, 8, 1]), store.common(b"q", [1, 5]), store.common(b"gone", [1])) == (4, 1, 0)
    store.put(b"s", _block(64))  # evicts p, the least recently used: no longer a candidate
    assert b"p" not in store and store.partial(b"", [1, 2, 3]) == (b"q", 2)
    store.clear()
    assert store.partial(b"", [1, 2, 7]) == (b"", 0)


def test_a_partial_block_is_its_first_positions():
    store = PrefixStore(capacity_bytes=10**6, block_size=4)
    k, v = mx.arange(2 * 4 * 3, dtype=mx.float32).reshape(1, 2, 4, 3), mx.ones((1, 2, 4, 3))
    store.put(b"a", [(k, v)], parent=b"", ids=[1, 2, 3, 4])
    [(pk, pv)] = store.take_part(b"a", 3)
    assert pk.shape == pv.shape == (1, 2, 3, 3) and mx.array_equal(pk, k[:, :, :3, :]).item()


def test_group_prefill_reuses_a_shared_prefix_that_ends_inside_a_block(model):
    """Rows sharing a 37-token prefix (2 blocks of 16, then 5 ids): after the first forward (rows 0 and 1,
    nothing held yet) rows 2 and 3 reuse all 37 tokens (the 2 blocks, then the first 5 positions of row 0's
    third block: ``PrefixStore.partial``) and share one forward, though row 3 alone could reuse 3 more (its
    tail begins as row 1's); each row's greedy tokens equal a run without prefix caching."""
    greedy = GenerateParams(max_tokens=4, logprobs=1, ignore_eos=True)
    shared, t0, t1, t2 = SHARED[:37], ids(10, 12), ids(11, 12), ids(12, 10)
    assert len({t0[0], t1[0], t2[0]}) == 3 and t0[0] != t1[0]  # the tails differ from their first id
    prompts = [shared + t0, shared + t1, shared + t2, shared + t1[:3] + ids(13, 8)]
    requests = [Request(i, p, greedy) for i, p in enumerate(prompts)]
    eng = engine(model, exact=False)
    be = BatchEngine(eng, 2, 256, prefill_batch=True)
    got = dict(be.run(requests))
    assert [got[i].cached_prompt_tokens for i in range(4)] == [0, 0, 37, 37]
    assert be.prefill_counts == {64: 1, 16: 1}
    assert eng.prefill_tokens == 49 + 49 + 10 + 11
    ref = dict(BatchEngine(engine(model, gb=0), 2, 256, prefill_batch=True).run(requests))
    for i in range(4):
        assert got[i].token_ids == ref[i].token_ids, i
        assert got[i].logprobs == pytest.approx(ref[i].logprobs, abs=TOL["full"]), i


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_equals_a_prefill_without_reuse(model, kind):
    shared_engine = engine(model, **KINDS[kind])
    for i, (prompt, params) in enumerate(zip(PROMPTS, [GREEDY, SAMPLED] * 3)):
        before = shared_engine.prefill_tokens
        got = shared_engine.generate(prompt, params)
        alone = engine(model, **KINDS[kind]).generate(prompt, params)
        assert (got.cached_prompt_tokens, alone.cached_prompt_tokens) == (CACHED[i], 0), i
        assert shared_engine.prefill_tokens - before == len(prompt) - CACHED[i]
        same(got, alone)


TOL = {"full": 1e-4, "quantized": 1e-2, "rotating": 1e-4, "rotating-quantized": 1e-2}
# one block of the model above: 2 layers x (keys, values) x 2 KV heads x 16 positions x 32 dims, in float32
# (128 bytes a position) or packed (32 dims x bits / 8 bytes) plus a float32 scale and bias for the one group
BLOCK_BYTES = {"full": 2 * 2 * 2 * B * 128, "rotating": 2 * 2 * 2 * B * 128,
               "quantized": 2 * 2 * 2 * B * (4 * 4 + 8), "rotating-quantized": 2 * 2 * 2 * B * (4 * 8 + 8)}


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_with_prefill_step_chunks_gives_the_same_greedy_tokens(model, kind):
    """``exact_prefix`` False (the GPU's rule) run on the CPU: what is not reused runs in prefill_step_size
    chunks, its full blocks stored as views of one copy per layer; the same blocks are reused as with
    exact chunks, and each row's greedy tokens equal a prefill without prefix caching."""
    fast = engine(model, exact=False, **KINDS[kind])
    assert not fast.exact_prefix and engine(model, **KINDS[kind]).exact_prefix
    for i, prompt in enumerate(PROMPTS):
        before = fast.prefill_tokens
        got = fast.generate(prompt, GREEDY)
        alone = engine(model, gb=0, **KINDS[kind]).generate(prompt, GREEDY)
        assert got.cached_prompt_tokens == CACHED[i], i
        assert fast.prefill_tokens - before == len(prompt) - CACHED[i]
        assert got.token_ids == alone.token_ids, i
        assert got.logprobs == pytest.approx(alone.logprobs, abs=TOL[kind]), i
    assert len(fast.prefix) == 7 + 2 + 2 and fast.prefix.nbytes == len(fast.prefix) * BLOCK_BYTES[kind]


def test_prefix_cache_off_prefills_as_before(model):
    off = engine(model, gb=0)
    assert off.prefix is None and off.block_size is None
    for prompt in PROMPTS[:2] + PROMPTS[:1]:
        g = off.generate(prompt, GREEDY)
        assert g.cached_prompt_tokens == 0
        plain = Engine(model, [0], 512, compile=False)  # no cache spec: today's engine
        same(g, plain.generate(prompt, GREEDY))
    assert off.prefill_tokens == 2 * len(PROMPTS[0]) + len(PROMPTS[1])


def test_n_samples_prefill_once(model):
    eng = engine(model)
    prompt = SHARED + ids(9, 9)
    params = [GenerateParams(max_tokens=8, temperature=1.0, seed=s, logprobs=0) for s in range(4)]
    got = [eng.generate(prompt, p) for p in params]
    assert eng.prefill_tokens == len(prompt)
    assert [g.cached_prompt_tokens for g in got] == [0] + [len(prompt)] * 3
    assert len({tuple(g.token_ids) for g in got}) > 1  # the samples differ; each equals its own prefill
    for g, p in zip(got, params):
        same(g, engine(model).generate(prompt, p))


def test_a_rotating_window_limits_reuse_and_logs_once(model, caplog):
    eng = engine(model, max_kv_size=40)  # 2 whole blocks fit the window
    first = eng.generate(PROMPTS[0], GREEDY)
    with caplog.at_level("WARNING", logger="pipeline"):
        got = eng.generate(PROMPTS[3], GREEDY)
        again = eng.generate(SHARED + ids(5, 3), GREEDY)
    assert first.cached_prompt_tokens == 0 and got.cached_prompt_tokens == again.cached_prompt_tokens == 32
    assert sum("prefix reuse stops at 32 tokens" in r.message for r in caplog.records) == 1
    same(got, engine(model, max_kv_size=40).generate(PROMPTS[3], GREEDY))


def test_quantized_kv_start_turns_block_reuse_off_but_samples_still_share(model, caplog):
    with caplog.at_level("WARNING", logger="pipeline"):
        eng = engine(model, kv_bits=8, kv_group_size=32, quantized_kv_start=40)
        assert eng.prefix is None and "quantized_kv_start" in eng.prefix_off
        a = eng.generate(PROMPTS[0], GREEDY)
        b = eng.generate(PROMPTS[3], GREEDY)
        c = eng.generate(PROMPTS[3], SAMPLED)
    assert (a.cached_prompt_tokens, b.cached_prompt_tokens, c.cached_prompt_tokens) == (0, 0, len(PROMPTS[3]))
    assert sum("quantized_kv_start" in r.message for r in caplog.records) == 1
    same(c, engine(model, kv_bits=8, kv_group_size=32, quantized_kv_start=40).generate(PROMPTS[3], SAMPLED))


def test_eviction_under_a_tiny_prefix_cache(model):
    per_block = 2 * 2 * 2 * B * 32 * 4  # layers x (k, v) x kv heads x block x head_dim x float32
    eng = engine(model, gb=2.5 * per_block / 1e9)  # room for 2 blocks
    a = eng.generate(PROMPTS[0], GREEDY)  # 7 blocks computed: the last 2 held, the chain's head evicted
    assert eng.prefix.nbytes == 2 * per_block and eng.prefix.evictions == 5
    b = eng.generate(PROMPTS[3], GREEDY)
    assert (a.cached_prompt_tokens, b.cached_prompt_tokens) == (0, 0)
    same(b, engine(model).generate(PROMPTS[3], GREEDY))
    short = eng.generate(SHARED[:40], GREEDY)  # its 2 blocks fill the store again...
    again = eng.generate(SHARED[:40] + [7], GREEDY)  # ...and are reused
    assert (short.cached_prompt_tokens, again.cached_prompt_tokens) == (0, 32)
    same(again, engine(model).generate(SHARED[:40] + [7], GREEDY))
    assert eng.prefix.nbytes <= eng.prefix.capacity_bytes


def _batched(model, requests, *, prefill_batch=False, **cache):
    eng = engine(model, **cache)
    out = dict(BatchEngine(eng, 3, 256, prefill_batch=prefill_batch).run(requests))
    return out, eng


@pytest.mark.parametrize("kind", ["full", "quantized"])
def test_batched_slots_loaded_from_the_store_equal_slots_without_reuse(model, kind):
    params = [GREEDY, SAMPLED] * 3
    requests = [Request(i, p, params[i]) for i, p in enumerate(PROMPTS)]
    got, eng = _batched(model, requests, **KINDS[kind])
    for i, r in enumerate(requests):
        alone, _ = _batched(model, [r], **KINDS[kind])
        same(got[i], alone[i])
        assert alone[i].cached_prompt_tokens == 0
    # Rows 0-2 are admitted together (3 free slots) before any prefix is stored; later rows reuse.
    assert [got[i].cached_prompt_tokens for i in range(len(PROMPTS))] == [0, 0, 16, 96, 48, 64]
    assert eng.prefill_tokens == sum(len(p) for p in PROMPTS) - 224


def test_group_prefill_leaves_the_store_alone(model):
    """With ``exact_prefix`` (the CPU's rule) group prefill (forced on here) neither reads nor adds blocks:
    its forward has other shapes than one-block chunks (a reused block would match only to rounding). A
    prompt sharing 48 tokens with a grouped one reuses nothing and gives its own tokens."""
    short = SHARED[:50]
    requests = [Request(0, short, GREEDY), Request(1, ids(7, 30), GREEDY), Request(2, ids(8, 30), GREEDY),
                Request(3, short[:48] + [3, 4], GREEDY)]
    got, eng = _batched(model, requests, prefill_batch=True)
    assert [got[i].cached_prompt_tokens for i in range(4)] == [0, 0, 0, 0]
    assert len(eng.prefix) == 0
    ref, _ = _batched(model, requests[3:], prefill_batch=True)
    assert got[3].token_ids == ref[3].token_ids and got[3].logprobs == ref[3].logprobs


def test_group_prefill_with_reuse_gives_the_same_greedy_tokens(model):
    """The GPU's rule (``exact_prefix`` False) with group prefill (forced on here): group forwards store
    their rows' full blocks, and requests reusing the same blocks are prefilled together, the blocks loaded
    once for the forward and only the rest computed; each row's greedy tokens equal a run without prefix
    caching. Three slots: the first three rows are admitted together (nothing stored yet, three buckets);
    when they end, rows 3 and 4 (SHARED's 100 tokens reused: 6 blocks, then 4 positions of row 0's seventh
    block; 7 and 10 computed: bucket 16) share one forward and row 5 (2 blocks and 8 positions of row 0's
    third: another chain) gets its own."""
    greedy = GenerateParams(max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [SHARED + ids(1, 20), ids(2, 40), ids(3, 30),
               SHARED + ids(4, 7), SHARED + ids(5, 10), SHARED[:40] + ids(6, 9)]
    requests = [Request(i, p, greedy) for i, p in enumerate(prompts)]
    eng = engine(model, exact=False)
    be = BatchEngine(eng, 3, 256, prefill_batch=True)
    got = dict(be.run(requests))
    assert [got[i].cached_prompt_tokens for i in range(6)] == [0, 0, 0, 100, 100, 40]
    assert eng.prefill_tokens == sum(len(p) for p in prompts) - 240
    assert be.prefill_counts == {128: 1, 64: 1, 32: 1, 16: 2}
    assert len(eng.prefix) == 7 + 2 + 1 + 1  # rows 0-2's full blocks, and row 5's third (rows 3, 4: none new)
    ref = dict(BatchEngine(engine(model, gb=0), 3, 256, prefill_batch=True).run(requests))
    for i in range(6):
        assert got[i].token_ids == ref[i].token_ids, i
        assert got[i].logprobs == pytest.approx(ref[i].logprobs, abs=TOL["full"]), i


def test_samples_of_one_prompt_share_a_group_prefill_row(model):
    """Group prefill with prefix caching on: the samples of one prompt admitted together take one row of the
    forward (prefilled once, every sample's prompt counted as reused), and each sample draws the same tokens
    as in a run without prefix caching, where every request takes its own row."""
    prompt, other = SHARED[:40], ids(9, 20)
    params = [GenerateParams(max_tokens=6, temperature=0.9, seed=s, logprobs=1, ignore_eos=True) for s in range(3)]
    requests = [Request(i, prompt, p) for i, p in enumerate(params)] + [Request(3, other, params[0])]
    eng = engine(model, exact=False)
    be = BatchEngine(eng, 4, 256, prefill_batch=True)
    got = dict(be.run(requests))
    assert be.prefill_counts == {64: 1, 32: 1}  # the three samples in one forward, the other prompt in its own
    assert eng.prefill_tokens == len(prompt) + len(other)
    assert [got[i].cached_prompt_tokens for i in range(4)] == [0, len(prompt), len(prompt), 0]
    assert len({tuple(got[i].token_ids) for i in range(3)}) > 1  # the samples differ
    ref = dict(BatchEngine(engine(model, gb=0), 4, 256, prefill_batch=True).run(requests))
    for i in range(4):  # the same tokens; logprobs to rounding (rows of other content share the forward)
        assert got[i].token_ids == ref[i].token_ids, i
        assert got[i].logprobs == pytest.approx(ref[i].logprobs, abs=TOL["full"]), i


@pytest.mark.parametrize("window", [16, 40])
def test_blocks_of_a_ring_that_has_wrapped_are_not_stored(model, window):
    """The GPU's rule (``exact_prefix`` False) prefills a prompt in ``prefill_step_size`` chunks, then stores its
    blocks from the caches. A rotating layer whose prompt outran its window had written later positions over
    the first slots, and those were stored as the prompt's first blocks: a later prompt sharing that head
    reused them and gave other tokens, with nothing said."""
    head = ids(11, 32)
    a, b = head + ids(12, 60), head + ids(13, 10)  # a: 92 tokens, past the window; b shares its first 2 blocks
    eng = engine(model, exact=False, max_kv_size=window)
    eng.generate(a, GREEDY)
    got = eng.generate(b, GREEDY)
    assert got.cached_prompt_tokens == 0  # nothing of a's head was left in the ring to store
    ref = engine(model, gb=0, max_kv_size=window).generate(b, GREEDY)
    assert got.token_ids == ref.token_ids
    assert max(abs(x - y) for x, y in zip(got.logprobs, ref.logprobs)) < 1e-4
    # a prompt within the window still stores and reuses its blocks
    eng.generate(head[:window], GREEDY)
    assert eng.generate(b, GREEDY).cached_prompt_tokens == min(32, window // B * B)


def test_group_prefill_reusing_blocks_past_the_capacity_bucket(model):
    """A prompt reusing 32 held tokens whose 208-token rest pads to a 256 bucket: its group caches hold 288
    positions, more than the 256-position slot. Loading them into the slot raised a broadcast error that stopped
    the whole run; only padding lies past the prompt, and the row runs as without reuse."""
    greedy = GenerateParams(max_tokens=6, logprobs=2, ignore_eos=True)
    head = ids(21, 32)
    a, b = head + ids(22, 8), head + ids(23, 208)
    eng = Engine(model, [0], 512, prefill_step_size=256, compile=False, exact_prefix=False,
                 cache_spec=CacheSpec(prefix_cache_gb=1.0, prefix_block_size=B))
    be = BatchEngine(eng, 2, 256, prefill_batch=True)
    assert {k.capacity for k in be.kinds} == {256}
    dict(be.run([Request("a", a, greedy)]))
    got = dict(be.run([Request("b", b, greedy)]))["b"]
    assert got.cached_prompt_tokens == 32
    ref = Engine(model, [0], 512, prefill_step_size=256, compile=False).generate(b, greedy)
    assert got.token_ids == ref.token_ids
