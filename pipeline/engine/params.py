"""``GenerateParams`` (one request's sampling and stop settings) and ``Generation`` (its result)."""

from __future__ import annotations

from dataclasses import dataclass

from .structured import StructuredOutputsParams


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
            cut before the earliest match.
        stop_token_ids: ids that end the generation besides the model's EOS ids.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text) in the
            completion.
        skip_special_tokens: leave special tokens out of the completion text.
        logprobs: None for none; k >= 0 returns each generated token's logprob and the k most likely
            alternatives (of the raw model distribution, before any structured-output mask).
        structured: constrain the completion to a JSON Schema, any JSON object, a regex, a choice or a
            grammar (``engine.structured``; None: unconstrained). EOS and ``stop_token_ids`` are allowed
            only where the grammar accepts; a completed value ends with "stop" even before
            ``min_tokens``; a stop string may still cut the value.
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
