"""``GenerateParams`` (one request's sampling and stop settings) and ``Generation`` (its result)."""

from __future__ import annotations

from dataclasses import dataclass

from .structured import StructuredOutputsParams

# max_tokens, min_tokens and top_k reach the device as int32 scalars (engine.sampler.sampler_consts), as do
# sizes and positions of the KV cache (cache.max_kv_size, cache.quantized_kv_start: engine.cache compares
# offsets with them on the device); the job's engine.batch_size and engine.prefill_step_size get the same bound
INT32_LIMIT = 2**31


class GenerateParamsError(ValueError):
    """Generation settings out of range (``GenerateParams.check``): one line, each problem naming its
    parameter, several joined by "; "."""


@dataclass(frozen=True)
class GenerateParams:
    """Per-request generation settings (names and meanings as vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        min_tokens: tokens generated before EOS, ``stop_token_ids`` or ``stop`` strings may end the
            generation (stop tokens are masked out of the distribution until then; a stop string must end in
            the text of a later token, as vLLM's detokenizer).
        temperature: 0 is greedy (so is anything below 1e-5, vLLM's ``_SAMPLING_EPS``); above, samples from
            ``softmax(logits / temperature)``.
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
            cut before the earliest match. One string or a list is accepted (as vLLM) and stored as a tuple.
        stop_token_ids: ids that end the generation besides the model's EOS ids. One int or a list is
            accepted and stored as a tuple.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text) in the
            completion.
        skip_special_tokens: leave special tokens out of the completion text.
        logprobs: None for none; k >= 0 returns each generated token's logprob and the k most likely
            alternatives (of the raw model distribution, before any structured-output mask).
        structured: constrain the completion to a JSON Schema, any JSON object, a regex, a choice or a
            grammar (``engine.structured``; None: unconstrained). EOS and ``stop_token_ids`` are allowed
            only where the grammar accepts; a completed value ends with "stop" even before
            ``min_tokens``; a stop string may still cut the value.

    Ranges (vLLM's ``SamplingParams._verify_args``) are not checked on construction: ``check`` does.
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
    structured: StructuredOutputsParams | None = None

    def __post_init__(self):
        # vLLM's SamplingParams takes one stop string (or None) as well as a list; a list is kept as a tuple
        for name, one in (("stop", str), ("stop_token_ids", int)):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                value = () if value is None else (value,) if isinstance(value, one) else tuple(value)
                object.__setattr__(self, name, value)

    def problems(self, where: str = "") -> list[str]:
        """Every setting out of range, one line each naming its key (prefixed by ``where``), e.g.
        "top_p must be in (0, 1], got 0"; the ranges of vLLM's ``SamplingParams._verify_args``, with
        ``logprobs`` at most 20 (vLLM's default ``max_logprobs``) and counts below 2**31 (``INT32_LIMIT``)."""
        out = []

        def bad(key, rule, value):
            out.append(f"{where}{key} must be {rule}, got {value!r}")

        finite = lambda v: v == v and abs(v) != float("inf")  # noqa: E731
        if self.max_tokens < 1:
            bad("max_tokens", ">= 1", self.max_tokens)
        if self.min_tokens < 0 or self.max_tokens >= 1 and self.min_tokens > self.max_tokens:
            bad("min_tokens", f">= 0 and <= max_tokens ({self.max_tokens})", self.min_tokens)
        if not (finite(self.temperature) and self.temperature >= 0):
            bad("temperature", "a finite number >= 0", self.temperature)
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            bad("top_k", "-1, 0 (off) or >= 1", self.top_k)
        for key in ("max_tokens", "min_tokens", "top_k"):
            if getattr(self, key) >= INT32_LIMIT:
                bad(key, "< 2**31", getattr(self, key))
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]", self.min_p)
        if not (finite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        for key in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, key) <= 2:
                bad(key, "in [-2, 2]", getattr(self, key))
        if not 0 <= self.seed < 2**63:
            bad("seed", "in [0, 2**63)", self.seed)
        for i, s in enumerate(self.stop):
            if not s:
                bad(f"stop[{i}]", "a non-empty string", s)
        for i, t in enumerate(self.stop_token_ids):
            if t < 0:
                bad(f"stop_token_ids[{i}]", ">= 0", t)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "null or in [0, 20]", self.logprobs)
        return out

    def check(self):
        """Raises: GenerateParamsError: one line naming every setting out of range (``problems``)."""
        found = self.problems()
        if found:
            raise GenerateParamsError("; ".join(found))


@dataclass
class Generation:
    """One finished generation.

    Attributes:
        token_ids: generated ids; the EOS / stop token that ended the generation is not included.
        text: the completion: ``tokenizer.decode(token_ids)`` up to its last complete character (a
            generation cut inside a multi-byte character leaves its bytes out of the text, not out of
            ``token_ids``; ``Tokenizer.decode_complete``), cut at the earliest stop string (None when the
            engine has no tokenizer).
        finish_reason: "stop" (EOS, a stop token, a stop string, or a structured value completed) or
            "length" (``max_tokens`` or the context limit).
        stop_reason: the matched stop string, the id of the stop token, or None ("length").
        stop_token_id: the EOS / stop token id that ended it, or None.
        prompt_tokens: prompt length in tokens.
        cached_prompt_tokens: prompt tokens whose KV was reused instead of computed (prefix caching:
            ``Engine.prefill_prompt``); 0 without it.
        ttft_s: seconds from the start of prefill until the first generated token was available.
        prefill_tps: prompt tokens per second of prefill (prompt_tokens / ttft_s).
        decode_tps: generated tokens per second after the first one (tokens/s); None if only one token.
        total_s: seconds for the whole request.
        peak_memory_bytes: MLX peak memory during the request, in bytes.
        compiled: whether decode ran through the compiled closure set.
        fused: whether decode ran through the fused CUDA step (``pipeline.engine.cuda``).
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
    cached_prompt_tokens: int = 0
