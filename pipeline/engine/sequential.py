"""``Engine``: one loaded model generating for one prompt at a time, with caches reset between prompts."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import NamedTuple

import mlx.core as mx

from ..models.base import output_logits
from .cache import make_caches
from .compiled import ClosureSet
from .params import GenerateParams, Generation
from .prefix import PrefixStore, block_hashes
from .request import Decoding
from .sampler import sample_step
from .step import choose_path, request_blocker
from .views import head, layer_capacity, layer_kind, prefill_pad, put_head

log = logging.getLogger("pipeline")


class _Buffers(NamedTuple):
    """What ``FusedDecoder.step`` reads of a cache, for a traced step: its buffers and ring size."""

    keys: mx.array
    values: mx.array
    max_size: int | None


class Engine:
    """Generates for one prompt at a time with a single model and a reused set of KV caches.

    Prefill runs eagerly in chunks; decode runs on the path ``step.choose_path`` picks when the engine
    is built: the fused CUDA step, the compiled closure set (``pipeline.engine.compiled.ClosureSet``) or
    eagerly; a request the compiled step cannot serve runs eagerly and the reason is logged once.

    Args:
        model: a model from ``pipeline.models.build_model`` (``model(inputs (1, L) int32, cache)``
            returns logits ``(1, L, vocab)``, ``model.make_cache()`` declares per-layer caches).
        eos_token_ids: ids that end a generation.
        context_length: most positions the model supports (prompt + generated tokens).
        prefill_step_size: prompt tokens per prefill chunk (without prefix caching).
        cache_spec: a ``pipeline.jobspec.CacheSpec`` (max_kv_size, kv_bits, ..., and prefix caching:
            ``prefix_cache_gb`` > 0 with ``prefix_block_size``), or None for the model's own layout and
            no prefix caching.
        compile: decode through compiled closures: True, False, or "auto" (``step.compile_by_default``).
        fused: decode through ``pipeline.engine.cuda`` (five custom CUDA kernels per layer) when
            ``fused_blocker`` allows it: "auto" or True (tried first, before ``compile``), or False.
        tokenizer: a ``pipeline.tokenizer.Tokenizer`` for completion text and stop strings (None:
            token ids only).
        batch_size: the slots a ``BatchEngine`` over this engine decodes together (> 1: the batched
            path, for which no fused decoder is built).
        exact_prefix: with prefix caching on, prefill in chunks of one block at absolute block boundaries,
            so that a row reusing blocks is bitwise the row without reuse (``prefill_prompt``); False:
            prefill what is not reused in ``prefill_step_size`` chunks (fewer, larger forwards; reuse
            changes the arithmetic of the rest, not which greedy tokens win, to float rounding). None
            (default): True on the CPU, False on a GPU, where one-block chunks cost a launch per kernel
            per 32 tokens and a wait for the device per block.
        pad_prefill: run a prompt's last prefill chunk padded (after the prompt) to a power-of-two length of
            at least ``views.PREFILL_MIN_BUCKET`` tokens (``views.prefill_pad``; at most
            ``prefill_step_size``), the padding then trimmed from the caches, so that prefill meets at most a
            handful of shapes (each compiled at its first use) instead of one per prompt length: on a fresh
            H200 a job's first 100 rows ran at 34% of their rate on a warm kernel cache, new prompt lengths
            compiling as they came (docs/BENCHMARKS.md). Only where every cache can trim (no quantized
            storage, no ring the padding would wrap). Off by default: a fresh H200 ran a
            job slower with it, not faster (11 rows in 78 s after the warm-up, against 100 rows in 98 s
            without it; docs/BENCHMARKS.md, 2026-12-03), for a reason not yet found.

    Attributes:
        path: the ``step.DecodePath`` chosen.
        prefix: the ``prefix.PrefixStore`` of prompt blocks (``prefill_prompt``), or None: prefix caching off
            (``prefix_cache_gb`` 0), or a cache layout it cannot serve exactly (``prefix_off``).
        prefix_off: why a job with prefix caching on has no store (quantized storage after
            ``quantized_kv_start`` > 0), or None.
        block_size: tokens per prefix block while prefix caching is on, else None.
        exact_prefix: as the argument, resolved (True or False).
        prefill_tokens: prompt tokens run through the model by ``prefill_prompt`` so far (reused ones not
            counted).
        tokens_generated: tokens this engine (and any ``BatchEngine`` over it) has generated so far, stop
            tokens excluded, as ``Generation.token_ids`` counts them; a plain int bumped once per token, so
            another thread may read it for live progress (the runner's tok/s).

    Raises:
        CacheConfigError: a cache spec the model cannot use (e.g. kv_group_size not dividing head_dim).
    """

    def __init__(self, model, eos_token_ids, context_length: int, prefill_step_size: int = 512,
                 cache_spec=None, compile: bool | str = True, tokenizer=None, fused: bool | str = "auto",
                 batch_size: int = 1, exact_prefix: bool | None = None, pad_prefill: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.prefill_step_size = prefill_step_size
        self.cache = make_caches(model, cache_spec)
        self.max_kv_size = getattr(cache_spec, "max_kv_size", None)
        self.path = choose_path(model, self.cache, compile=compile, fused=fused, batch_size=batch_size)
        self.compile = self.path.compiled
        self.compile_setting = compile  # as asked (True, False, "auto"): the batched CUDA step has its own rule
        self.fused = self.path.decoder
        # True (default): the fused step mx.compiled once per buffer layout and replayed (False: built token by
        # token, bench variant "fused"); on an H200 the replay decoded Llama-3.2-1B at 995.7 tok/s against 620.2
        # and SmolLM2-135M at 525.3 against 327.2 (docs/BENCHMARKS.md, 2026-12-03)
        self.compile_fused = True
        self._fused_closures: dict = {}
        self.closures = ClosureSet(model)
        self._logged: set[str] = set()
        self._quiet = False
        self.tokens_generated = 0
        if self.path.note:
            self.note(self.path.note)
        gb = getattr(cache_spec, "prefix_cache_gb", 0) or 0
        self.block_size = getattr(cache_spec, "prefix_block_size", None) if gb > 0 else None
        self.prefix_off = None
        if gb > 0 and any(c.bits is not None and c.start for c in self.cache):
            self.prefix_off = ("no prefix reuse with cache.quantized_kv_start > 0 (a block's stored form depends "
                               "on the prompt's length)")
        self.prefix = PrefixStore(int(gb * 1e9), self.block_size) if gb > 0 and not self.prefix_off else None
        windows = [c.max_size for c in self.cache if c.max_size is not None]
        self._window = min(windows) if windows else None
        self.exact_prefix = mx.default_device() == mx.cpu if exact_prefix is None else bool(exact_prefix)
        self.pad_prefill = pad_prefill
        self.prefill_tokens = 0
        self._last: tuple | None = None  # (prompt ids, last logits) while the caches hold exactly that prompt

    @property
    def closure_count(self) -> int:
        """Compiled closures built so far (bounded by the distinct graph shapes met)."""
        return len(self.closures.closures)

    @property
    def trace_count(self) -> int:
        """Times a closure was traced; constant while generations reuse existing closures."""
        return self.closures.trace_count

    def reset(self) -> None:
        self._last = None
        for c in self.cache:
            c.reset()

    def forward(self, token_ids: list[int]) -> mx.array:
        """Logits ``(vocab,)`` (float32) after ``token_ids``, from a freshly reset cache."""
        self.reset()
        logits = self.prefill(mx.array(token_ids, dtype=mx.uint32))
        return logits[0].astype(mx.float32)

    def prefill(self, prompt: mx.array, start: int = 0) -> mx.array:
        """Run ``prompt[start:]`` (``prompt`` ``(L,)`` uint32, ``start`` < L, the caches holding positions
        ``0:start``) through the model into the caches, in chunks of ``prefill_step_size``; returns the
        last position's logits ``(1, vocab)``."""
        n = prompt.shape[0]
        step = self.prefill_step_size
        while n - start > step:
            self.model(prompt[None, start : start + step], self.cache)
            mx.eval([c.state for c in self.cache])
            start += step
        size = self._padded(start, n - start)
        if size == n - start:
            return self.model(prompt[None, start:], self.cache, last_only=True)[:, -1, :]
        x = mx.concatenate([prompt[start:], mx.zeros((size - (n - start),), dtype=prompt.dtype)])
        h = self.model.model(x[None], self.cache)  # padding after the prompt: no prompt position sees it
        for c in self.cache:
            c.trim(n)
        return output_logits(self.model, h[:, n - start - 1 : n - start, :], False)[:, -1, :]

    def _padded(self, start: int, length: int) -> int:
        """The length the last prefill chunk (``length`` tokens after ``start``) runs at: ``length``, or with
        ``pad_prefill`` ``views.prefill_pad(length)`` if it fits the chunk size and every cache."""
        if not self.pad_prefill:
            return length
        size = prefill_pad(length)
        if size > self.prefill_step_size or any(c.bits is not None or (c.max_size is not None and start + size
                                                                         > c.max_size) for c in self.cache):
            return length
        return size

    def prefill_prompt(self, ids: list[int]) -> tuple[mx.array, int]:
        """Fill the caches with prompt ``ids`` (non-empty) and return ``(logits (1, vocab), cached)``: the
        last position's logits and how many of the prompt's tokens were reused, not computed.

        Prefix caching off: ``reset`` and ``prefill`` (chunks of ``prefill_step_size``), nothing reused.
        On: the prompt the caches hold already (the previous sample of the row: ``n`` > 1) is trimmed back
        to and its logits reused (every token reused); else the longest run of leading blocks held in
        ``prefix`` is loaded (at most the blocks before the one holding the last token, and within every
        rotating layer's window), the rest is computed, and each full block computed is added to ``prefix``.
        ``exact_prefix``: the rest runs in chunks of one block at absolute block boundaries (module
        ``prefix`` says why this is exact); else in ``prefill_step_size`` chunks, its full blocks then stored
        as views of one copy per layer, and nothing waits for the device.
        """
        n = len(ids)
        if self.block_size is None:
            self.reset()
            self.prefill_tokens += n
            return self.prefill(mx.array(ids, dtype=mx.uint32)), 0
        if self._last is not None and self._last[0] == ids and all(c.prefix_blocker(n) is None for c in self.cache):
            for c in self.cache:
                c.trim(n)
            return self._last[1], n
        self.reset()
        B, store = self.block_size, self.prefix
        if store is None:  # a layout without exact block reuse: only the previous sample's prompt is reused
            self.note(self.prefix_off, kind="prefix-off")
            self.prefill_tokens += n
            self._last = (list(ids), self.prefill(mx.array(ids, dtype=mx.uint32)))
            return self._last[1], 0
        keys = block_hashes(ids, B)
        usable = (n - 1) // B
        if self._window is not None and usable * B > self._window:
            usable = self._window // B
            if usable and store.hits(keys[:usable]) == usable:  # the blocks past the window are never held
                self.note(f"prefix reuse stops at {usable * B} tokens: a rotating layer keeps {self._window} "
                          "positions (cache.max_kv_size or the model's sliding window)", kind="prefix-window")
        blocks = store.take(keys[:usable])
        if blocks:
            cat = lambda parts: parts[0] if len(parts) == 1 else (  # noqa: E731
                tuple(mx.concatenate(p, axis=2) for p in zip(*parts)) if isinstance(parts[0], tuple)
                else mx.concatenate(parts, axis=2))
            for i, c in enumerate(self.cache):
                c.load_prefix(cat([b[i][0] for b in blocks]), cat([b[i][1] for b in blocks]))
        start = len(blocks) * B
        prompt = mx.array(ids, dtype=mx.uint32)
        self.prefill_tokens += n - start
        if not self.exact_prefix:
            logits = self.prefill(prompt, start)
            full = n // B if self._window is None else min(n, self._window) // B
            # a ring of ``_window`` slots that took n positions holds positions n - window .. window - 1 in their
            # own slots; the earlier ones were written over, so no block from ``start`` can be stored before them
            lost = 0 if self._window is None else n - self._window
            if full * B > start >= lost:
                copies = [c.stored_copy(start, full * B) for c in self.cache]
                store.put_range(keys[start // B : full], copies, parent=keys[start // B - 1] if start else b"",
                                ids=ids[start : full * B])
                mx.async_eval(copies)  # now, so the next write into the caches finds no reader of the old buffer
            self._last = (list(ids), logits)
            return logits, len(blocks) * B
        while True:
            end = min(start + B, n)
            if end == n:
                logits = self.model(prompt[None, start:end], self.cache, last_only=True)[:, -1, :]
            else:
                self.model(prompt[None, start:end], self.cache)
            copies = []
            if end - start == B and (self._window is None or end <= self._window):
                copies = [c.stored_copy(start, end) for c in self.cache]
                store.put(keys[start // B], copies)
            mx.eval(copies, [c.state for c in self.cache])  # the copies before a later write reuses a buffer
            if end == n:
                break
            start = end
        self._last = (list(ids), logits)
        return logits, len(blocks) * B

    def reusable(self, ids: list[int], keys: list[bytes] | None = None) -> int:
        """Prompt tokens of ``ids`` that ``prefill_prompt`` would reuse now (0 with prefix caching off);
        changes nothing. ``keys``: ``block_hashes(ids, block_size)`` if the caller has them."""
        if self.block_size is None:
            return 0
        if self._last is not None and self._last[0] == ids and all(c.prefix_blocker(len(ids)) is None
                                                                    for c in self.cache):
            return len(ids)
        if self.prefix is None:
            return 0
        usable = (len(ids) - 1) // self.block_size
        if self._window is not None:
            usable = min(usable, self._window // self.block_size)
        keys = block_hashes(ids, self.block_size) if keys is None else keys
        return self.prefix.hits(keys[:usable]) * self.block_size

    def drop_prefixes(self) -> None:
        """Forget every prefix block and the prompt the caches hold (after a warm-up's made-up prompt)."""
        self._last = None
        if self.prefix is not None:
            self.prefix.clear()

    @contextlib.contextmanager
    def quiet(self):
        """Within it, generations log no warnings and leave the once-per-engine ones unshown, so the
        first real row that meets one logs it with its own numbers (``LoadedModel.warm_up``'s made-up
        prompt is not the user's)."""
        was, self._quiet = self._quiet, True
        try:
            yield self
        finally:
            self._quiet = was

    def note(self, reason: str, kind: str = "eager") -> None:
        """Log ``reason`` once per engine (``kind`` "eager": why decode runs uncompiled; one
        "window" warning per engine); nothing inside ``quiet``."""
        tag = reason if kind == "eager" else kind
        if not self._quiet and tag not in self._logged:
            self._logged.add(tag)
            log.warning("decoding eagerly: %s" if kind == "eager" else "%s", reason)

    def _compiled_stepper(self, req: Decoding, sample: bool = True):
        """``(advance, finish, closure_key)`` running the compiled step, or None (reason logged) if it
        can't: ``advance(y) -> (next y, logprob arrays)`` (``sample`` False: ``(logits (1, vocab), ())``,
        the forward alone); ``finish(n_steps)`` hands the buffers back."""
        n_prompt, kind = req.n_prompt, req.kind if sample else None
        caps = [layer_capacity(c, n_prompt + req.max_tokens) for c in self.cache]
        kinds = tuple(layer_kind(c, cap) for c, cap in zip(self.cache, caps))
        reason = request_blocker(self.cache, self.closures.broken, (kinds, kind))
        if reason:  # shown here too: a failure to trace may have been met inside quiet()
            self.note(reason)
            return None
        for c, cap in zip(self.cache, caps):
            c.reserve(cap)
        step = self.closures.get(kinds, kind)
        n_state = len(req.state) if sample else 0
        n_extra = 0 if not sample or kind.logprobs is None else 3
        consts = req.consts if sample else ()
        live = {
            "pos": mx.array(n_prompt, dtype=mx.int32),
            "state": tuple(req.state) if sample else (),
            "buffers": [head(b, cap) for c, cap in zip(self.cache, caps) for b in (c.keys, c.values)],
        }

        def advance(y):
            out = step(y, live["pos"], *consts, *live["state"], *live["buffers"])
            live["pos"], live["state"] = out[1], out[2 : 2 + n_state]
            live["buffers"] = list(out[2 + n_state + n_extra :])
            return out[0], out[2 + n_state : 2 + n_state + n_extra]

        def finish(n_steps: int):
            for i, c in enumerate(self.cache):  # larger buffers of earlier prompts are kept, not shrunk
                c.keys = put_head(c.keys, live["buffers"][2 * i])
                c.values = put_head(c.values, live["buffers"][2 * i + 1])
                c.offset += n_steps

        return advance, finish, (kinds, kind)

    def _eager_stepper(self, req: Decoding, sample: bool = True):
        """``advance(y) -> (next y, logprob arrays)``: the model called on the caches, then the sampler
        (``sample`` False: ``(logits (1, vocab), ())``)."""

        def advance(y):
            logits = self.model(y[None], self.cache)[:, -1, :]
            if not sample:
                return logits, ()
            y_next, req.state, ex = sample_step(req.kind, logits, req.consts, req.state)
            return y_next, ex

        return advance

    def _fused_stepper(self, req: Decoding, sample: bool = True):
        """``advance(y)`` through the fused CUDA step, which writes every cache in place (``sample`` as
        ``_eager_stepper``): with ``compile_fused``, the step over every position of the caches' buffers
        (``FusedDecoder.step`` with ``n_ctx`` None), ``mx.compile``d once per buffer layout and replayed;
        else built token by token with the attention grid sized by the position."""
        self.fused.prepare(self.cache, req.n_prompt + req.max_tokens)
        at = {"pos": mx.array([req.n_prompt], dtype=mx.int32), "n": req.n_prompt}
        replay = self._fused_closure() if self.compile_fused else None
        buffers = [a for c in self.cache for a in (c.keys, c.values)]

        def advance(y):
            if replay is not None:
                logits = replay(y, at["pos"], *buffers)
            else:
                logits = self.fused.step(y, at["pos"], at["n"], self.cache)
            at["pos"], at["n"] = at["pos"] + 1, at["n"] + 1
            if not sample:
                return logits, ()
            y_next, req.state, ex = sample_step(req.kind, logits, req.consts, req.state)
            return y_next, ex

        return advance

    def _fused_closure(self):
        """The fused step ``mx.compile``d for the caches' current buffers (their shapes and the decoder's
        scratch key it: a cache that grows or a larger scratch gets a new one): ``(token, pos, *buffers)``
        -> logits, ``buffers`` each cache's keys then values, written in place."""
        dec = self.fused
        key = (tuple((c.keys.shape, c.keys.dtype, c.max_size) for c in self.cache), id(dec._scratch))
        fn = self._fused_closures.get(key)
        if fn is None:
            sizes = [c.max_size for c in self.cache]

            def step(token, pos, *buffers):
                views = [_Buffers(buffers[2 * i], buffers[2 * i + 1], m) for i, m in enumerate(sizes)]
                return dec.step(token, pos, None, views)

            fn = self._fused_closures[key] = mx.compile(step)
        return fn

    def generate(self, prompt_ids: list[int], params: GenerateParams) -> Generation:
        """Generate a completion for ``prompt_ids``.

        Decoding is asynchronous: step ``t + 1`` is queued (``mx.async_eval``) before token ``t`` is
        read back, so the host builds the next graph while the device computes. Sampling runs inside
        the step (``pipeline.engine.sampler.sample_step``), so one host read per token. With
        ``params.structured`` the step's forward is queued alone; token ``t`` is read, the grammar's mask
        for ``t + 1`` is computed on the host while the forward runs, then the masked sampling is queued.

        ``params`` is not range-checked here (the job path checked it at load, ``GenerationSpec.check``;
        the Python API in ``LoadedModel.generate``, ``GenerateParams.check``): an out-of-range value may
        fail deep in sampling with a raw MLX error.

        Raises:
            RowError: max_tokens < 1, an empty prompt, a prompt that fills the model's context, a grammar
                that does not compile.
            ValueError: stop strings or structured output without a tokenizer.
        """
        req = Decoding(self, prompt_ids, params)
        mx.reset_peak_memory()
        req.t0 = time.perf_counter()
        logits, req.cached = self.prefill_prompt(prompt_ids)
        y, extras = req.begin(logits)
        mx.async_eval(y, *extras, *req.state)

        decodes = req.max_tokens > 1
        fused = self.fused is not None and decodes
        sample = req.constraint is None  # a constrained request samples outside the step, with its mask
        advance, finish_compiled, probe = None, None, None
        if fused:
            advance = self._fused_stepper(req, sample)
        elif self.compile and decodes:
            compiled = self._compiled_stepper(req, sample)
            if compiled is not None:
                step, finish_compiled, closure_key = compiled
                try:
                    probe = step(y)  # first call traces (once per closure key)
                    mx.async_eval(probe[0], *probe[1])
                except Exception as e:  # a graph the compiler cannot express: never retry this key
                    self.closures.broken[closure_key] = f"{type(e).__name__}: {e}"
                    self.note(f"compiled step failed ({self.closures.broken[closure_key]})")
                    finish_compiled, probe = None, None
                else:
                    advance = step
        if advance is None:
            advance = self._eager_stepper(req, sample)

        n_steps = 0
        while True:
            if len(req.tokens) + 1 < req.max_tokens:
                if probe is not None and n_steps == 0:
                    y_next, ex_next = probe
                else:
                    y_next, ex_next = advance(y)
                    mx.async_eval(y_next, *ex_next)
                n_steps += 1
            done = req.push(y.item(), extras)
            if done:
                break
            if not sample:  # y_next: step t + 1's logits; the mask of token t's successors, made while they ran
                y_next, req.state, ex_next = sample_step(req.kind, y_next, req.consts, req.state,
                                                         req.allowed(y_next.shape[-1]))
                mx.async_eval(y_next, *ex_next)
            y, extras = y_next, ex_next
        if finish_compiled is not None:
            finish_compiled(n_steps)
        if fused:  # the fused step wrote n_steps slots of every cache in place
            for c in self.cache:
                c.offset += n_steps
        # max_tokens 1 runs no decode step: it reports the path a decode would have taken (the engine's setting)
        compiled = finish_compiled is not None if decodes else bool(self.compile) and self.fused is None
        return req.finish(done, compiled=compiled, fused=fused)
