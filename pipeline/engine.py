"""The generation engine: one loaded model, caches reset between prompts, one prompt at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from .sampler import sample


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
    extra: dict = field(default_factory=dict)


class Engine:
    """Generates for one prompt at a time with a single model and a reused set of KV caches.

    Args:
        model: a model from ``pipeline.models.build_model`` (``model(inputs (1, L) int32, cache)``
            returns logits ``(1, L, vocab)``, ``model.make_cache()`` gives per-layer caches).
        eos_token_ids: ids that end a generation.
        context_length: most positions the model supports (prompt + generated tokens).
        prefill_step_size: prompt tokens per prefill chunk.
    """

    def __init__(self, model, eos_token_ids, context_length: int, prefill_step_size: int = 512):
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.prefill_step_size = prefill_step_size
        self.cache = model.make_cache()

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
        tokens: list[int] = []
        finish, stop_id = "length", None
        t_first = None
        while True:
            if len(tokens) + 1 < max_tokens:
                y_next = next_token(self.model(y[None], self.cache)[:, -1, :])
                mx.async_eval(y_next)
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
        )
