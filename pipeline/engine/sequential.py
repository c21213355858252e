"""``Engine``: one loaded model generating for one prompt at a time, with caches reset between prompts."""

from __future__ import annotations

import contextlib
import logging
import time

import mlx.core as mx

from .cache import make_caches
from .compiled import ClosureSet
from .params import GenerateParams, Generation
from .request import Decoding
from .sampler import sample_step
from .step import choose_path, request_blocker
from .views import head, layer_capacity, layer_kind, put_head

log = logging.getLogger("pipeline")


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
        prefill_step_size: prompt tokens per prefill chunk.
        cache_spec: a ``pipeline.jobspec.CacheSpec`` (max_kv_size, kv_bits, ...), or None for the
            model's own layout.
        compile: decode through compiled closures: True, False, or "auto" (``step.compile_by_default``).
        fused: decode through ``pipeline.engine.cuda`` (five custom CUDA kernels per layer) when
            ``fused_blocker`` allows it: "auto" or True (tried first, before ``compile``), or False.
        tokenizer: a ``pipeline.tokenizer.Tokenizer`` for completion text and stop strings (None:
            token ids only).
        batch_size: the slots a ``BatchEngine`` over this engine decodes together (> 1: the batched
            path, for which no fused decoder is built).

    Attributes:
        path: the ``step.DecodePath`` chosen.
        tokens_generated: tokens this engine (and any ``BatchEngine`` over it) has generated so far, stop
            tokens excluded, as ``Generation.token_ids`` counts them; a plain int bumped once per token, so
            another thread may read it for live progress (the runner's tok/s).

    Raises:
        CacheConfigError: a cache spec the model cannot use (e.g. kv_group_size not dividing head_dim).
    """

    def __init__(self, model, eos_token_ids, context_length: int, prefill_step_size: int = 512,
                 cache_spec=None, compile: bool | str = True, tokenizer=None, fused: bool | str = "auto",
                 batch_size: int = 1):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.prefill_step_size = prefill_step_size
        self.cache = make_caches(model, cache_spec)
        self.max_kv_size = getattr(cache_spec, "max_kv_size", None)
        self.path = choose_path(model, self.cache, compile=compile, fused=fused, batch_size=batch_size)
        self.compile = self.path.compiled
        self.fused = self.path.decoder
        self.closures = ClosureSet(model)
        self._logged: set[str] = set()
        self._quiet = False
        self.tokens_generated = 0
        if self.path.note:
            self.note(self.path.note)

    @property
    def closure_count(self) -> int:
        """Compiled closures built so far (bounded by the distinct graph shapes met)."""
        return len(self.closures.closures)

    @property
    def trace_count(self) -> int:
        """Times a closure was traced; constant while generations reuse existing closures."""
        return self.closures.trace_count

    def reset(self) -> None:
        for c in self.cache:
            c.reset()

    def forward(self, token_ids: list[int]) -> mx.array:
        """Logits ``(vocab,)`` (float32) after ``token_ids``, from a freshly reset cache."""
        self.reset()
        logits = self.prefill(mx.array(token_ids, dtype=mx.uint32))
        return logits[0].astype(mx.float32)

    def prefill(self, prompt: mx.array) -> mx.array:
        """Run ``prompt`` ``(L,)`` uint32 through the model into the caches, in chunks of
        ``prefill_step_size``; returns the last position's logits ``(1, vocab)``."""
        n = prompt.shape[0]
        step = self.prefill_step_size
        start = 0
        while n - start > step:
            self.model(prompt[None, start : start + step], self.cache)
            mx.eval([c.state for c in self.cache])
            start += step
        return self.model(prompt[None, start:], self.cache, last_only=True)[:, -1, :]

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
        ``_eager_stepper``)."""
        self.fused.prepare(self.cache, req.n_prompt + req.max_tokens)
        at = {"pos": mx.array([req.n_prompt], dtype=mx.int32), "n": req.n_prompt}

        def advance(y):
            logits = self.fused.step(y, at["pos"], at["n"], self.cache)
            at["pos"], at["n"] = at["pos"] + 1, at["n"] + 1
            if not sample:
                return logits, ()
            y_next, req.state, ex = sample_step(req.kind, logits, req.consts, req.state)
            return y_next, ex

        return advance

    def generate(self, prompt_ids: list[int], params: GenerateParams) -> Generation:
        """Generate a completion for ``prompt_ids``.

        Decoding is asynchronous: step ``t + 1`` is queued (``mx.async_eval``) before token ``t`` is
        read back, so the host builds the next graph while the device computes. Sampling runs inside
        the step (``pipeline.engine.sampler.sample_step``), so one host read per token. With
        ``params.structured`` the step's forward is queued alone; token ``t`` is read, the grammar's mask
        for ``t + 1`` is computed on the host while the forward runs, then the masked sampling is queued.

        Raises:
            RowError: max_tokens < 1, an empty prompt, a prompt that fills the model's context, a grammar
                that does not compile.
            ValueError: stop strings or structured output without a tokenizer.
        """
        req = Decoding(self, prompt_ids, params)
        self.reset()
        mx.reset_peak_memory()
        req.t0 = time.perf_counter()
        y, extras = req.begin(self.prefill(mx.array(prompt_ids, dtype=mx.uint32)))
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
        return req.finish(done, compiled=finish_compiled is not None, fused=fused)
