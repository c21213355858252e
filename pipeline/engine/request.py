"""The request in flight: its checks, stop ids, sampler set-up, token push and finished ``Generation``.

``Decoding`` is the one place both decode loops (``Engine.generate`` and ``BatchEngine.run``) keep what a
request is: they differ only in how the next token is computed (eager, compiled, fused or batched
step); how a token is recorded, when a request ends and how its result is built is shared here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import RowError
from .params import GenerateParams, Generation
from .sampler import SamplerKind, sample_step, sampler_consts, sampler_state
from .stops import StopChecker, final_text
from .structured import Constraint, TokenMask, allowed_tokens


@dataclass
class Request:
    """One generation to run: ``tag`` comes back with its result (e.g. ``(row id, sample index)``)."""

    tag: object
    prompt_ids: list[int]
    params: GenerateParams


class Decoding:
    """One request from its checks to its ``Generation``.

    Construct it, prefill the prompt, call ``begin`` with the last position's logits (the first token),
    then ``push`` every token read back until it returns how the request ended, then ``finish``.

    Args:
        engine: the ``Engine`` whose model runs the request (its EOS ids, context length, tokenizer,
            ``max_kv_size`` and ``tokens_generated`` counter are used).
        prompt_ids: the prompt's token ids.
        params: the request's ``GenerateParams``.
        capacity: most positions (prompt + generated) the decode loop can hold (a batch's buffers), or
            None for no limit besides the model's context.
        tag: the caller's name for the request (``Request.tag``), kept as ``tag``.

    Attributes:
        max_tokens: tokens this request may generate: ``params.max_tokens`` capped by the context.
        stop_ids: ids that end it (``stop_token_ids``, plus the EOS ids unless ``ignore_eos`` without
            ``structured``: with a grammar, ``ignore_eos`` is kept by its masks, ``Constraint.fix_stops``).
        kind, consts, state: the sampler's ``SamplerKind``, ``SamplerConsts`` and current
            ``SamplerState`` (set by ``begin``; a decode loop that keeps the state elsewhere, such as
            the compiled step, may leave ``state`` at the first token's).
        constraint: the request's ``structured.Constraint`` (its grammar's matcher), or None.
        tokens: the ids generated so far (a stop token is not included).
        cached: prompt tokens reused, not computed, by its prefill (set by the loop; ``Engine.prefill_prompt``).
        t0, t_first: ``time.perf_counter()`` at the start of prefill and when the first token was
            read back (set by the loop).

    Raises:
        RowError: ``max_tokens`` < 1, an empty prompt, a prompt that fills the model's context, or (with
            ``capacity``) prompt + ``max_tokens`` over it.
        ValueError: stop strings or ``structured`` with an engine that has no tokenizer.
    """

    def __init__(self, engine, prompt_ids: list[int], params: GenerateParams, capacity: int | None = None,
                 tag: object = None):
        n_prompt = len(prompt_ids)
        if params.max_tokens < 1:
            raise RowError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if n_prompt == 0:
            raise RowError("prompt has no tokens")
        if n_prompt >= engine.context_length:
            raise RowError(f"prompt has {n_prompt} tokens; the model's context is {engine.context_length}")
        if (params.stop or params.structured) and engine.tokenizer is None:
            raise ValueError("stop strings and structured output need an engine with a tokenizer")
        self.max_tokens = min(params.max_tokens, engine.context_length - n_prompt)
        if capacity is not None and n_prompt + self.max_tokens > capacity:
            raise RowError(f"prompt of {n_prompt} tokens + max_tokens {self.max_tokens} exceeds the batch "
                           f"capacity of {capacity} positions")
        if engine.max_kv_size is not None and n_prompt > engine.max_kv_size:
            engine.note(f"a prompt of {n_prompt} tokens is longer than cache.max_kv_size {engine.max_kv_size}: "
                         "its first tokens (the system turn, say) are out of the attention window", "window")
        self.engine, self.prompt_ids, self.params, self.tag = engine, prompt_ids, params, tag
        # ignore_eos with a grammar: its masks offer EOS only where the value is complete (nothing else allowed),
        # and an EOS taken there ends the row as a stop (``Constraint.fix_stops``)
        eos = params.ignore_eos and params.structured is None
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if eos else engine.eos_token_ids)
        self.checker = StopChecker(engine.tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens) \
            if params.stop else None
        self.constraint = Constraint(params.structured, engine.tokenizer, engine.eos_token_ids, self.stop_ids,
                                     ignore_eos=params.ignore_eos) \
            if params.structured is not None else None
        self.tokens: list[int] = []
        self.cached = 0
        self.block_keys: list[bytes] | None = None  # prefix.block_hashes of the prompt, once needed (BatchEngine)
        self.picked: list[tuple] = []  # each recorded token's logprob arrays
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    def begin(self, logits: mx.array) -> tuple[mx.array, tuple]:
        """Sampler set-up and the first token from the prefill's last logits ``(1, vocab)``; returns
        ``(token (1,) uint32, logprob arrays)``, lazy."""
        vocab = logits.shape[-1]
        self.kind = SamplerKind.of(self.params, self.stop_ids)
        self.consts = sampler_consts(self.params, vocab, self.stop_ids)
        first = sampler_state(self.kind, self.params.seed, self.prompt_ids, vocab)
        y, self.state, extras = sample_step(self.kind, logits, self.consts, first, self.allowed(vocab))
        return y, extras

    def allowed(self, vocab: int) -> TokenMask | None:
        """The tokens the request's grammar allows next (one row over ``vocab`` logits), or None without a
        constraint."""
        return None if self.constraint is None else allowed_tokens(self.constraint.mask(), vocab)

    def push(self, tok: int, extras: tuple) -> tuple | None:
        """Record one token read back (``extras``: its logprob arrays); returns ``(finish_reason,
        stop_token_id, stop_reason)`` if the request ends with it, else None: ``settle(tok, record(tok,
        extras))``.

        A stop id ends it with "stop" and is not recorded; a token that completes the structured value
        (the grammar admits no further token) ends it with "stop"; a stop string ends it where it ends in the
        text of a token after the first ``min_tokens`` (as vLLM's detokenizer); the ``max_tokens``-th token ends
        it with "length".

        Raises:
            RowError: the structured-output grammar rejects the token (``Constraint.consume``).
        """
        return self.settle(tok, self.record(tok, extras))

    def record(self, tok: int, extras: tuple) -> tuple | None:
        """``push`` without the structured-output check (which touches the grammar's matcher, so a batch can
        record its tokens while llguidance advances the matchers on another thread): records the token and
        returns how the request ends by stop id, stop string or length (or None); ``settle`` then gives
        the final answer."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if tok in self.stop_ids:
            return "stop", tok, tok
        self.tokens.append(tok)
        self.picked.append(extras)
        self.engine.tokens_generated += 1
        if self.checker is not None:
            matched = self.checker.push(tok)
            if matched is not None and len(self.tokens) > self.params.min_tokens:  # vLLM's detokenizer (#22014)
                return "stop", None, matched
        if len(self.tokens) >= self.max_tokens:
            return "length", None, None
        return None

    def settle(self, tok: int, done: tuple | None) -> tuple | None:
        """How the request ends after ``record(tok, ...)`` returned ``done``: the grammar's verdict on ``tok``
        comes first (a rejected token raises, a complete value ends it with "stop"), then ``done``. A stop
        id is never given to the grammar.

        Raises:
            RowError: the structured-output grammar rejects the token (``Constraint.consume``).
        """
        if self.constraint is None or (done is not None and done[1] is not None):
            return done
        self.constraint.consume(tok)
        if self.constraint.stopped:
            return "stop", None, None
        return done

    def finish(self, done: tuple, *, compiled: bool, fused: bool = False) -> Generation:
        """The finished ``Generation`` (logprobs and text filled in) for ``done`` as ``push`` returned it."""
        finish, stop_id, stop_reason = done
        t_end = time.perf_counter()
        ttft = self.t_first - self.t0
        gen = Generation(token_ids=self.tokens, finish_reason=finish, stop_token_id=stop_id,
                         prompt_tokens=self.n_prompt, ttft_s=ttft, prefill_tps=self.n_prompt / ttft, decode_tps=None,
                         total_s=0.0, peak_memory_bytes=int(mx.get_peak_memory()), compiled=compiled, fused=fused,
                         stop_reason=stop_reason, cached_prompt_tokens=self.cached)
        n_decoded = len(self.tokens) + (stop_id is not None) - 1
        if n_decoded > 0 and t_end > self.t_first:
            gen.decode_tps = n_decoded / (t_end - self.t_first)
        if self.kind.logprobs is not None:
            self._fill_logprobs(gen)
        if self.engine.tokenizer is not None:
            self._fill_text(gen)
        gen.total_s = time.perf_counter() - self.t0
        return gen

    def _fill_logprobs(self, gen: Generation) -> None:
        if not self.picked:
            gen.logprobs, gen.top_token_ids, gen.top_logprobs = [], [], []
            return
        chosen, ids, vals = (mx.concatenate([p[i] for p in self.picked]) for i in range(3))
        gen.logprobs, gen.top_token_ids, gen.top_logprobs = chosen.tolist(), ids.tolist(), vals.tolist()

    def _fill_text(self, gen: Generation) -> None:
        """The completion text; a stop string counts only where it ends in text of a token after the first
        ``min_tokens``, as ``push`` checks it. A row that ended at ``max_tokens`` is cut at a stop string too, and
        ends with "stop": the incremental detokenizer holds back a piece that ends in an unfinished
        character, so a stop in the last tokens' text may have reached no ``push``."""
        params, tokenizer = self.params, self.engine.tokenizer
        ids = gen.token_ids
        if gen.stop_token_id is not None and params.include_stop_str_in_output:
            ids = ids + [gen.stop_token_id]
        min_end = 0
        if params.stop and params.min_tokens > 0:  # characters of the first min_tokens tokens
            min_end = len(tokenizer.decode_complete(ids[: params.min_tokens],
                                                    skip_special_tokens=params.skip_special_tokens))
        text, matched = final_text(tokenizer, ids, params.stop,
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop_str_in_output=params.include_stop_str_in_output, min_end=min_end)
        gen.text = text
        if matched is not None:
            gen.finish_reason, gen.stop_reason = "stop", matched
