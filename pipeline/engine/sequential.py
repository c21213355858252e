"""The generation engine: one loaded model, caches reset between prompts, one prompt at a time."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import mlx.core as mx

from .cache import KVCache, make_caches
from .compiled import ClosureSet, cpu_compile_blocker, decode_blocker, head, layer_capacity, layer_kind, put_head
from .fused import decoder_for, fused_blocker
from .sampler import SamplerKind, sample_step, sampler_consts, sampler_state
from .stops import StopChecker, final_text

log = logging.getLogger("pipeline")


@dataclass(frozen=True)
class GenerateParams:
    """Per-request generation settings (names and meanings as vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        min_tokens: tokens generated before EOS, ``stop_token_ids`` or ``stop`` strings may end the
            generation (stop tokens are masked out of the distribution until then).
        temperature: 0 is greedy; > 0 samples from ``softmax(logits / temperature)``.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1: off).
        top_k: keep the k most likely tokens (0 or -1: off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0: off).
        repetition_penalty: HF/CTRL penalty (Keskar et al. 2019) on ids in the prompt and output:
            positive logits divided by it, negative multiplied (1: off).
        presence_penalty: subtracted from the logit of every id already generated (OpenAI's definition).
        frequency_penalty: subtracted once per earlier occurrence of the id in the output.
        seed: the request's seed (see ``sampler.row_seed``).
        ignore_eos: keep generating past EOS (for benchmarks).
        stop: strings that end the generation when they appear in the decoded text; the completion is
            cut before the earliest match.
        stop_token_ids: ids that end the generation besides the model's EOS ids.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text) in the
            completion.
        skip_special_tokens: leave special tokens out of the completion text.
        logprobs: None for none; k >= 0 returns each generated token's logprob and the k most likely
            alternatives (of the raw model distribution).
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None


@dataclass
class Generation:
    """One finished generation.

    Attributes:
        token_ids: generated ids; the EOS / stop token that ended the generation is not included.
        text: the completion: ``tokenizer.decode(token_ids)`` up to its last complete character (a
            generation cut inside a multi-byte character leaves its bytes out of the text, not out of
            ``token_ids``; ``Tokenizer.decode_complete``), cut at the earliest stop string (None when the
            engine has no tokenizer).
        finish_reason: "stop" (EOS, a stop token or a stop string) or "length" (``max_tokens`` or the
            context limit).
        stop_reason: the matched stop string, the id of the stop token, or None ("length").
        stop_token_id: the EOS / stop token id that ended it, or None.
        prompt_tokens: prompt length in tokens.
        ttft_s: seconds from the start of prefill until the first generated token was available.
        prefill_tps: prompt tokens per second of prefill (prompt_tokens / ttft_s).
        decode_tps: generated tokens per second after the first one (tokens/s); None if only one token.
        total_s: seconds for the whole request.
        peak_memory_bytes: MLX peak memory during the request, in bytes.
        compiled: whether decode ran through the compiled closure set.
        fused: whether decode ran through the fused CUDA step (``pipeline.fused``).
        logprobs: natural-log probability of each id of ``token_ids`` (None unless requested).
        top_token_ids: per generated token, the ``logprobs`` most likely ids, most likely first.
        top_logprobs: their log probabilities.
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
    fused: bool = False
    text: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def compile_by_default(caches) -> bool:
    """The "auto" rule for ``compile``: compiled decode, except on MLX's CUDA backend when every layer
    has a plain full-attention cache.

    Measured (docs/BENCHMARKS.md, 2026-11-29, random 4-bit weights, 256 new tokens): on a 2-core
    x86_64 CPU compiled decode of the default model ran 12.0 vs 10.0 tok/s eager. On an NVIDIA H200
    (mlx 0.32.4) with full caches the compiled step launched 960 kernels per token vs 549 eager
    (whole-buffer copies for the cache writes, the mask, the select) and lost: SmolLM2-135M 139 vs
    214 tok/s, Llama-3.2-1B 234 vs 463, Qwen2.5-7B 117 vs 175 (prompt 64); with Gemma 3's sliding
    layers it won, 131 vs 102 tok/s (prompt 2048). Rotating and quantized caches on CUDA were not
    measured apart from Gemma 3, so they keep the compiled step. Where MLX cannot compile on the CPU
    (no ``g++``: ``compiled.cpu_compile_blocker``) the engine decodes eagerly whatever ``compile`` says.
    """
    if not mx.cuda.is_available():
        return True
    return any(type(c) is not KVCache for c in caches)


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
        compile: decode through compiled closures: True, False, or "auto" (``compile_by_default``).
        fused: decode through ``pipeline.fused`` (five custom CUDA kernels per layer) when
            ``fused_blocker`` allows it: "auto" or True (tried first, before ``compile``), or False.
        tokenizer: a ``pipeline.tokenizer.Tokenizer`` for completion text and stop strings (None:
            token ids only).

    Attributes:
        tokens_generated: tokens this engine (and any ``BatchEngine`` over it) has generated so far, stop
            tokens excluded, as ``Generation.token_ids`` counts them; a plain int bumped once per token, so
            another thread may read it for live progress (the runner's tok/s).

    Raises:
        CacheConfigError: a cache spec the model cannot use (e.g. kv_group_size not dividing head_dim).
    """

    def __init__(self, model, eos_token_ids, context_length: int, prefill_step_size: int = 512,
                 cache_spec=None, compile: bool | str = True, tokenizer=None, fused: bool | str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.prefill_step_size = prefill_step_size
        self.cache = make_caches(model, cache_spec)
        self.max_kv_size = getattr(cache_spec, "max_kv_size", None)
        self.compile = compile_by_default(self.cache) if compile == "auto" else compile
        if self.compile and cpu_compile_blocker() is not None:
            self.compile = False  # mx.compile would hand back the step uncompiled (warn_if_no_cpu_compile)
        self.closures = ClosureSet(model)
        self._logged: set[str] = set()
        self._quiet = False
        self.tokens_generated = 0
        reason = fused_blocker(model, self.cache) if fused else "off"
        self.fused = decoder_for(model) if reason is None else None
        if fused is True and reason is not None:
            self._note(f"no fused step ({reason})")

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

    def _note(self, reason: str, kind: str = "eager") -> None:
        """Log ``reason`` once per engine (``kind`` "eager": why decode runs uncompiled; one
        "window" warning per engine); nothing inside ``quiet``."""
        tag = reason if kind == "eager" else kind
        if not self._quiet and tag not in self._logged:
            self._logged.add(tag)
            log.warning("decoding eagerly: %s" if kind == "eager" else "%s", reason)

    def _compiled_stepper(self, n_prompt: int, max_tokens: int, kind: SamplerKind, consts, state):
        """``(advance, finish, closure_key)`` running the compiled step, or None (reason logged) if it
        can't: ``advance(y) -> (next y, logprob arrays)``; ``finish(n_steps)`` hands the buffers back."""
        reason = decode_blocker(self.cache)
        if reason:
            self._note(reason)
            return None
        caps = [layer_capacity(c, n_prompt + max_tokens) for c in self.cache]
        for c, cap in zip(self.cache, caps):
            c.reserve(cap)
        kinds = tuple(layer_kind(c, cap) for c, cap in zip(self.cache, caps))
        if (kinds, kind) in self.closures.broken:  # shown here too: the failure may have been met inside quiet()
            self._note(f"compiled step failed ({self.closures.broken[(kinds, kind)]})")
            return None
        step = self.closures.get(kinds, kind)
        n_state, n_extra = len(state), 0 if kind.logprobs is None else 3
        live = {
            "pos": mx.array(n_prompt, dtype=mx.int32),
            "state": tuple(state),
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

    def generate(self, prompt_ids: list[int], params: GenerateParams) -> Generation:
        """Generate a completion for ``prompt_ids``.

        Decoding is asynchronous: step ``t + 1`` is queued (``mx.async_eval``) before token ``t`` is
        read back, so the host builds the next graph while the device computes. Sampling runs inside
        the step (``pipeline.sampler.sample_step``), so one host read per token.

        Raises:
            ValueError: max_tokens < 1, an empty prompt, a prompt that fills the model's context, or
                stop strings without a tokenizer.
        """
        n_prompt = len(prompt_ids)
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if n_prompt == 0:
            raise ValueError("prompt has no tokens")
        if n_prompt >= self.context_length:
            raise ValueError(f"prompt has {n_prompt} tokens; the model's context is {self.context_length}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        max_tokens = min(params.max_tokens, self.context_length - n_prompt)
        if self.max_kv_size is not None and n_prompt > self.max_kv_size:
            self._note(f"a prompt of {n_prompt} tokens is longer than cache.max_kv_size {self.max_kv_size}: "
                       "its first tokens (the system turn, say) are out of the attention window", "window")
        self.reset()
        mx.reset_peak_memory()
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)

        t0 = time.perf_counter()
        logits = self._prefill(mx.array(prompt_ids, dtype=mx.uint32))
        vocab = logits.shape[-1]
        kind = SamplerKind.of(params, stop_ids)
        consts = sampler_consts(params, vocab, stop_ids)
        y, state, extras = sample_step(kind, logits, consts, sampler_state(kind, params.seed, prompt_ids, vocab))
        mx.async_eval(y, *extras, *state)

        def advance(y):
            nonlocal state
            y_next, state, ex = sample_step(kind, self.model(y[None], self.cache)[:, -1, :], consts, state)
            return y_next, ex

        finish_compiled = None
        fused = self.fused is not None and max_tokens > 1
        if fused:
            self.fused.prepare(self.cache, n_prompt + max_tokens)
            at = {"pos": mx.array([n_prompt], dtype=mx.int32), "n": n_prompt}

            def advance(y):  # noqa: F811 - the fused step replaces the model call
                nonlocal state
                logits = self.fused.step(y, at["pos"], at["n"], self.cache)
                at["pos"], at["n"] = at["pos"] + 1, at["n"] + 1
                y_next, state, ex = sample_step(kind, logits, consts, state)
                return y_next, ex

        elif self.compile and max_tokens > 1:
            compiled = self._compiled_stepper(n_prompt, max_tokens, kind, consts, state)
            if compiled is not None:
                step, finish_compiled, closure_key = compiled
                try:
                    probe = step(y)  # first call traces (once per closure key)
                    mx.async_eval(probe[0], *probe[1])
                except Exception as e:  # a graph the compiler cannot express: never retry this key
                    self.closures.broken[closure_key] = f"{type(e).__name__}: {e}"
                    self._note(f"compiled step failed ({self.closures.broken[closure_key]})")
                    finish_compiled = None
                else:
                    advance = step

        checker = StopChecker(self.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens) \
            if params.stop else None
        tokens: list[int] = []
        picked: list[tuple] = []
        finish, stop_id, stop_reason = "length", None, None
        t_first = None
        n_steps = 0
        while True:
            if len(tokens) + 1 < max_tokens:
                if finish_compiled is not None and n_steps == 0:
                    y_next, ex_next = probe
                else:
                    y_next, ex_next = advance(y)
                    mx.async_eval(y_next, *ex_next)
                n_steps += 1
            else:
                y_next = None
            tok = y.item()
            if t_first is None:
                t_first = time.perf_counter()
            if tok in stop_ids:
                finish, stop_id, stop_reason = "stop", tok, tok
                break
            tokens.append(tok)
            picked.append(extras)
            self.tokens_generated += 1
            if checker is not None:
                matched = checker.push(tok)
                if matched is not None and len(tokens) >= params.min_tokens:
                    finish, stop_reason = "stop", matched
                    break
            if y_next is None:
                break
            y, extras = y_next, ex_next
        if finish_compiled is not None:
            finish_compiled(n_steps)
        if fused:  # the fused step wrote n_steps slots of every cache in place
            for c in self.cache:
                c.offset += n_steps
        t_end = time.perf_counter()
        gen = Generation(
            token_ids=tokens,
            finish_reason=finish,
            stop_token_id=stop_id,
            prompt_tokens=n_prompt,
            ttft_s=t_first - t0,
            prefill_tps=n_prompt / (t_first - t0),
            decode_tps=None,
            total_s=0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            compiled=finish_compiled is not None,
            fused=fused,
            stop_reason=stop_reason,
        )
        n_decoded = len(tokens) + (stop_id is not None) - 1
        decode_s = t_end - t_first
        gen.decode_tps = (n_decoded / decode_s) if n_decoded > 0 and decode_s > 0 else None
        if kind.logprobs is not None:
            self._fill_logprobs(gen, picked)
        if self.tokenizer is not None:
            self._fill_text(gen, params)
        gen.total_s = time.perf_counter() - t0
        return gen

    @staticmethod
    def _fill_logprobs(gen: Generation, picked: list[tuple]) -> None:
        if not picked:
            gen.logprobs, gen.top_token_ids, gen.top_logprobs = [], [], []
            return
        chosen, ids, vals = (mx.concatenate([p[i] for p in picked]) for i in range(3))
        gen.logprobs, gen.top_token_ids, gen.top_logprobs = chosen.tolist(), ids.tolist(), vals.tolist()

    def _fill_text(self, gen: Generation, params: GenerateParams) -> None:
        """The completion text; a stop string counts only where it ends in text of token ``min_tokens``
        or later, as the generation loop checks it."""
        ids = gen.token_ids
        if gen.stop_token_id is not None and params.include_stop_str_in_output:
            ids = ids + [gen.stop_token_id]
        text, matched = final_text(self.tokenizer, ids, params.stop if gen.finish_reason == "stop" else (),
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop_str_in_output=params.include_stop_str_in_output,
                                   min_end=self._min_end(ids, params))
        gen.text = text
        if matched is not None:
            gen.stop_reason = matched

    def _min_end(self, ids: list[int], params: GenerateParams) -> int:
        """Characters of text before the ``min_tokens``-th token, where no stop string may end."""
        if not params.stop or params.min_tokens <= 1:
            return 0
        return len(self.tokenizer.decode_complete(ids[: params.min_tokens - 1],
                                                  skip_special_tokens=params.skip_special_tokens))
