"""The generation engine: one loaded model, caches reset between prompts, one prompt at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx

from .cache import make_caches
from .compiled import ClosureSet, decode_blocker, head, layer_capacity, layer_kind, put_head
from .sampler import categorical, sample

log = logging.getLogger("pipeline")


@dataclass(frozen=True)
class GenerateParams:
    """Per-request generation settings (names as vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 is greedy.
        seed: the request's seed (see ``sampler.row_seed``).
        ignore_eos: keep generating past EOS (for benchmarks).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class Generation:
    """One finished generation.

    Attributes:
        token_ids: generated ids, EOS excluded.
        finish_reason: "stop" (an EOS token) or "length" (``max_tokens`` or the context limit).
        stop_token_id: the EOS id that stopped it, or None.
        prompt_tokens: prompt length in tokens.
        ttft_s: seconds from the start of prefill until the first generated token was available.
        prefill_tps: prompt tokens per second of prefill (prompt_tokens / ttft_s).
        decode_tps: generated tokens per second after the first one (tokens/s); None if only one token.
        total_s: seconds for the whole request.
        peak_memory_bytes: MLX peak memory during the request, in bytes.
        compiled: whether decode ran through the compiled closure set.
    """

    token_ids: list[int]
    finish_reason: str
    stop_token_id: int | None
    prompt_tokens: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float | None
    total_s: float
    peak_memory_bytes: int
    compiled: bool = False


class Engine:
    """Generates for one prompt at a time with a single model and a reused set of KV caches.

    Prefill runs eagerly in chunks; decode runs through the compiled closure set
    (``pipeline.compiled.ClosureSet``) unless ``compile`` is false or the generation cannot be expressed
    as a fixed-capacity step, in which case it runs eagerly and the reason is logged once.

    Args:
        model: a model from ``pipeline.models.build_model`` (``model(inputs (1, L) int32, cache)``
            returns logits ``(1, L, vocab)``, ``model.make_cache()`` declares per-layer caches).
        eos_token_ids: ids that end a generation.
        context_length: most positions the model supports (prompt + generated tokens).
        prefill_step_size: prompt tokens per prefill chunk.
        cache_spec: a ``pipeline.jobspec.CacheSpec`` (max_kv_size, kv_bits, ...), or None for the
            model's own layout.
        compile: decode through compiled closures.

    Raises:
        CacheConfigError: a cache spec the model cannot use (e.g. kv_group_size not dividing head_dim).
    """

    def __init__(self, model, eos_token_ids, context_length: int, prefill_step_size: int = 512,
                 cache_spec=None, compile: bool = True):
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.prefill_step_size = prefill_step_size
        self.cache = make_caches(model, cache_spec)
        self.max_kv_size = getattr(cache_spec, "max_kv_size", None)
        self.compile = compile
        self.closures = ClosureSet(model, categorical)
        self._logged: set[str] = set()

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
        logits = self._prefill(mx.array(token_ids, dtype=mx.uint32))
        return logits[0].astype(mx.float32)

    def _prefill(self, prompt: mx.array) -> mx.array:
        """Run the prompt through the model in chunks; returns the last position's logits ``(1, vocab)``."""
        n = prompt.shape[0]
        step = self.prefill_step_size
        start = 0
        while n - start > step:
            self.model(prompt[None, start : start + step], self.cache)
            mx.eval([c.state for c in self.cache])
            start += step
        return self.model(prompt[None, start:], self.cache, last_only=True)[:, -1, :]

    def _note(self, reason: str, kind: str = "eager") -> None:
        """Log ``reason`` once per engine (``kind`` "eager": why decode runs uncompiled; one
        "window" warning per engine)."""
        tag = reason if kind == "eager" else kind
        if tag not in self._logged:
            self._logged.add(tag)
            log.warning("decoding eagerly: %s" if kind == "eager" else "%s", reason)

    def _compiled_stepper(self, n_prompt: int, max_tokens: int, params: GenerateParams, key):
        """A function ``y -> next y`` running the compiled step, or None (reason logged) if it can't."""
        reason = decode_blocker(self.cache)
        if reason:
            self._note(reason)
            return None
        caps = [layer_capacity(c, n_prompt + max_tokens) for c in self.cache]
        for c, cap in zip(self.cache, caps):
            c.reserve(cap)
        kinds = tuple(layer_kind(c, cap) for c, cap in zip(self.cache, caps))
        sampler = "greedy" if params.temperature == 0 else "sample"
        if (kinds, sampler) in self.closures.broken:
            return None
        step = self.closures.get(kinds, sampler)
        state = {
            "pos": mx.array(n_prompt, dtype=mx.int32),
            "key": key if key is not None else mx.random.key(0),
            "buffers": [head(b, cap) for c, cap in zip(self.cache, caps) for b in (c.keys, c.values)],
        }
        inv_temperature = mx.array(1.0 / params.temperature if params.temperature > 0 else 1.0, dtype=mx.float32)

        def advance(y):
            out = step(y, state["pos"], state["key"], inv_temperature, *state["buffers"])
            state["pos"], state["key"], state["buffers"] = out[1], out[2], list(out[3:])
            return out[0]

        def finish(n_steps: int):
            for i, c in enumerate(self.cache):  # larger buffers of earlier prompts are kept, not shrunk
                c.keys = put_head(c.keys, state["buffers"][2 * i])
                c.values = put_head(c.values, state["buffers"][2 * i + 1])
                c.offset += n_steps

        return advance, finish, (kinds, sampler)

    def generate(self, prompt_ids: list[int], params: GenerateParams) -> Generation:
        """Generate a completion for ``prompt_ids``.

        Decoding is asynchronous: step ``t + 1`` is queued (``mx.async_eval``) before token ``t`` is
        read back, so the host builds the next graph while the device computes.

        Raises:
            ValueError: max_tokens < 1, an empty prompt, or a prompt that fills the model's context.
        """
        n_prompt = len(prompt_ids)
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if n_prompt == 0:
            raise ValueError("prompt has no tokens")
        if n_prompt >= self.context_length:
            raise ValueError(f"prompt has {n_prompt} tokens; the model's context is {self.context_length}")
        max_tokens = min(params.max_tokens, self.context_length - n_prompt)
        if self.max_kv_size is not None and n_prompt > self.max_kv_size:
            self._note(f"a prompt of {n_prompt} tokens is longer than cache.max_kv_size {self.max_kv_size}: "
                       "its first tokens (the system turn, say) are out of the attention window", "window")
        self.reset()
        mx.reset_peak_memory()
        key = mx.random.key(params.seed) if params.temperature > 0 else None

        def next_token(logits):
            nonlocal key
            sub = None
            if key is not None:
                key, sub = mx.random.split(key)
            return sample(logits.astype(mx.float32), params.temperature, sub)

        t0 = time.perf_counter()
        y = next_token(self._prefill(mx.array(prompt_ids, dtype=mx.uint32)))
        mx.async_eval(y)

        advance = lambda y: next_token(self.model(y[None], self.cache)[:, -1, :])  # noqa: E731
        finish_compiled = None
        if self.compile and max_tokens > 1:
            compiled = self._compiled_stepper(n_prompt, max_tokens, params, key)
            if compiled is not None:
                step, finish_compiled, closure_key = compiled
                try:
                    y_probe = step(y)  # first call traces (once per closure key)
                    mx.async_eval(y_probe)
                except Exception as e:  # a graph the compiler cannot express: never retry this key
                    self.closures.broken[closure_key] = str(e)
                    self._note(f"compiled step failed ({type(e).__name__}: {e})")
                    finish_compiled = None
                else:
                    advance, pending = step, y_probe

        tokens: list[int] = []
        finish, stop_id = "length", None
        t_first = None
        n_steps = 0
        while True:
            if len(tokens) + 1 < max_tokens:
                if finish_compiled is not None and n_steps == 0:
                    y_next = pending
                else:
                    y_next = advance(y)
                    mx.async_eval(y_next)
                n_steps += 1
            else:
                y_next = None
            tok = y.item()
            if t_first is None:
                t_first = time.perf_counter()
            if tok in self.eos_token_ids and not params.ignore_eos:
                finish, stop_id = "stop", tok
                break
            tokens.append(tok)
            if y_next is None:
                break
            y = y_next
        if finish_compiled is not None:
            finish_compiled(n_steps)
        t_end = time.perf_counter()
        ttft = t_first - t0
        n_decoded = len(tokens) + (finish == "stop") - 1
        decode_s = t_end - t_first
        return Generation(
            token_ids=tokens,
            finish_reason=finish,
            stop_token_id=stop_id,
            prompt_tokens=n_prompt,
            ttft_s=ttft,
            prefill_tps=n_prompt / ttft,
            decode_tps=(n_decoded / decode_s) if n_decoded > 0 and decode_s > 0 else None,
            total_s=t_end - t0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            compiled=finish_compiled is not None,
        )
