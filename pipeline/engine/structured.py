"""Structured output: token masks from llguidance (guidance-ai/llguidance) for a JSON Schema, any JSON
object, a regex, a choice of strings or a Lark grammar.

``StructuredOutputsParams`` names the constraint as vLLM's ``StructuredOutputsParams`` does. Each
constrained request gets a ``Constraint``: an ``llguidance.LLMatcher`` over the model's tokenizer, which
consumes every generated token and computes the mask of tokens allowed next (a bitmask, 32 ids per int32
word, bit ``i % 32`` of word ``i // 32``). The mask goes to the device as that bitmask (``allowed_tokens``:
a ``TokenMask``), and the sampler applies it before every sampler setting (``sampler.sample_step``,
``batch_sampler.sample_batch``; on MLX's CUDA backend one kernel, ``cuda.mask``). llguidance computes a
mask with the GIL released, so it runs while the device computes the step's forward (sequential decoding
queues the forward first, reads the previous token, then computes the mask; the batched loop hands a step's
tokens, still on the device, to a worker thread, ``SlotMasks``, which reads them and computes their masks while
the host launches the next forward).

EOS and the request's ``stop_token_ids`` are allowed only where the grammar accepts (llguidance sets the
EOS bits there; the other stop ids copy them). A request whose matcher has stopped (the grammar admits
no further token) ends with finish_reason "stop" without sampling an EOS.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from ..errors import JobSpecError, RowError
from .cuda.backend import on_cuda
from .cuda.mask import mask_kernel

KEYS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one field set), vLLM's ``StructuredOutputsParams`` names.

    Attributes:
        json: a JSON Schema (a mapping), or the path of a ``.json`` file holding one (relative to the
            working directory; ``check`` reads it and keeps the schema, so the fingerprint holds the
            schema, not the path).
        json_object: any JSON object (``True``).
        regex: the completion matches this regular expression (Rust ``regex`` syntax, whole match).
        choice: the completion is exactly one of these strings (a list is kept as a tuple, a single string
            as a tuple of one).
        grammar: a Lark grammar (llguidance's dialect; a llama.cpp GBNF grammar is converted).

    The fields are annotated ``object`` so that the job loader (``jobspec._build``) passes any value given
    in the job file through and ``check`` judges them: a key given a value of the wrong type then reads as
    one problem naming that key, not also as "set exactly one of ... (got none)". Their types are the ones
    above (``check`` says so when they are not).
    """

    json: object = None  # dict | str | None
    json_object: object = False  # bool
    regex: object = None  # str | None
    choice: object = None  # tuple[str, ...] | None
    grammar: object = None  # str | None

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        elif isinstance(self.choice, str):
            object.__setattr__(self, "choice", (self.choice,))

    @property
    def key(self) -> str:
        """The field that is set ("json", "json_object", "regex", "choice" or "grammar")."""
        return next(k for k in KEYS if _is_set(getattr(self, k)))

    def problem(self) -> tuple[str | None, str] | None:
        """The first problem of this constraint, or None: ``(key, text)`` where ``key`` is the field it
        concerns (None for the whole mapping) and ``text`` says what is wrong, without the key: not
        exactly one field set, a field of the wrong type, a schema file that cannot be read, a grammar that
        llguidance does not compile (no model needed). Reads a ``json`` schema file and keeps the schema."""
        set_ = [k for k in KEYS if _is_set(getattr(self, k))]
        if len(set_) != 1:
            got = ", ".join(set_) if set_ else "none"
            keys = ", ".join("json_object: true" if k == "json_object" else k for k in KEYS)
            return None, f"set exactly one of {keys} (got {got})"
        key = set_[0]
        value = getattr(self, key)
        wrong = {"json": not isinstance(value, (dict, str)),
                 "json_object": not isinstance(value, bool),
                 "regex": not isinstance(value, str),
                 "choice": not (isinstance(value, tuple) and value and all(isinstance(c, str) and c for c in value)),
                 "grammar": not isinstance(value, str)}[key]
        if wrong:
            want = {"json": "a JSON Schema (a mapping) or the path of a .json file holding one",
                    "json_object": "true or false", "regex": "a string",
                    "choice": "a non-empty list of non-empty strings", "grammar": "a string"}[key]
            shown = list(value) if isinstance(value, tuple) else value
            return key, f"must be {want}, got {type(shown).__name__} {shown!r}"
        if isinstance(self.json, str):
            path = Path(self.json)
            try:
                schema = json.loads(path.read_text(encoding="utf-8"))
            except OSError as e:
                return key, f"cannot read schema file {path}: {e.strerror}"
            except ValueError as e:
                return key, f"schema file {path} is not JSON: {e}"
            if not isinstance(schema, dict):
                return key, f"schema file {path} must hold a JSON object"
            object.__setattr__(self, "json", schema)
        try:
            problem = llguidance.LLMatcher.validate_grammar(self.lark())
        except ValueError as e:
            problem = str(e)
        if problem:
            return key, one_line(problem, key)
        return None

    def check(self, where: str = "generation.structured") -> None:
        """``problem()`` as a ``JobSpecError`` whose line starts with ``where`` and the key, e.g.
        "generation.structured.regex: invalid regex ...", "generation.structured.regex must be a string, got
        int 5" or "generation.structured: set exactly one of ...".

        Raises:
            JobSpecError: one line naming the key.
        """
        found = self.problem()
        if found is not None:
            raise JobSpecError(problem_line(where, *found))

    def lark(self) -> str:
        """The llguidance grammar (its JSON form, as ``llguidance.grammar_from`` builds it).

        Raises:
            ValueError: a schema llguidance cannot read (``check`` reports it as a JobSpecError).
        """
        if self.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(self.json)
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", list(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)


def one_line(message: str, key: str | None = None) -> str:
    """llguidance's error text on one line: its lines joined, the source excerpts and carets left out, and a
    rejected token's dump of the parser state and grammar (``<state>...``) cut; for a
    ``key`` of "regex" or "choice" also its leading "at LINE(COLUMN): ", a place in the grammar llguidance wrapped
    the value in, not in the value."""
    if key in ("regex", "choice"):
        message = re.sub(r"^at \d+\(\d+\): ", "", message)
    message = re.split(r"\s*<(?:state|grammar)>", message, maxsplit=1)[0]  # a matcher's dump of its state and grammar
    keep = [s.strip() for s in message.splitlines()
            if s.strip() and not set(s.strip()) <= {"^", " "} and "|" not in s[:8]]
    return " ".join(keep)


def _is_set(value) -> bool:
    """A field counts as set unless it is None or False (``json_object: false`` sets nothing); 0 and "" count."""
    return value is not None and value is not False


def problem_line(where: str, key: str | None, text: str) -> str:
    """A ``problem()`` as a line: ``where`` then the key (``where`` "": the key alone), joined to the text by
    " " where it reads on from the key ("regex must be a string, ..."), else by ": "; ``key`` None: the
    mapping's own problem after ``where``."""
    if key is None:
        return f"{where}: {text}" if where else text
    joiner = " " if text.startswith("must ") else ": "
    return f"{where}.{key}{joiner}{text}" if where else f"{key}{joiner}{text}"


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a ``pipeline.tokenizer.Tokenizer`` (built from its Hugging Face
    ``tokenizer.json`` text, the GGUF-built one included; ~0.4 s, so cached per tokenizer), with
    ``eos_token_ids`` as the ids the grammar allows where it accepts."""
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(eos_token_ids))


# llguidance's ``LLMatcher.deep_copy`` shares the copied matcher's lexer (its cache of lexer states, behind one
# mutex: parser/src/earley/parser.rs, ``Parser.shared``; python_ext's ``deep_copy`` clones without
# ``deep_clone``), so the masks of copies of one matcher, computed in parallel, wait for each other. Each
# request's matcher is copied from one of MATCHER_FAMILIES fresh matchers of its grammar (round robin), and the
# batched calls list the matchers family by family, so that llguidance's threads (rayon: contiguous chunks of the
# list) work on different lexers. As many families as llguidance has threads by default (80% of the CPUs), at most
# 8: on the H200's 16-core host, 256 JSON-schema matchers' masks took 1.2 ms a step with 8 or 12 families against
# 3.3 ms with one, and a B=256 job's JSON step 7.3-8.4 ms against 9.9 (docs/BENCHMARKS.md, 2026-12-04 evening).
MATCHER_FAMILIES = max(1, min(8, int(0.8 * (os.cpu_count() or 1))))
# llguidance's threads for a batch's masks (``LLExecutor(MASK_THREADS)``); None: llguidance's default, 80% of the CPUs,
# at most 32.
MASK_THREADS: int | None = None
_NEXT_FAMILY = itertools.count()


@functools.lru_cache(maxsize=256)
def _fresh_matcher(grammar: str, tok: llguidance.LLTokenizer, family: int) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(tok, grammar, log_level=0)


class Constraint:
    """One request's matcher: the mask of the tokens allowed next, and the tokens generated so far.

    Args:
        params: the request's ``StructuredOutputsParams``.
        tokenizer: the engine's ``pipeline.tokenizer.Tokenizer``.
        eos_token_ids: the engine's EOS ids (allowed where the grammar accepts).
        stop_ids: the request's ids that end it (``Decoding.stop_ids``); those that are not EOS ids take
            the EOS bit of every mask.
        ignore_eos: ``SamplingParams.ignore_eos``: the masks offer EOS only where the grammar allows nothing
            else (the value is complete).

    Raises:
        RowError: the grammar does not compile (a per-row value that ``check`` did not see).
    """

    def __init__(self, params: StructuredOutputsParams, tokenizer, eos_token_ids, stop_ids, ignore_eos: bool = False):
        tok = ll_tokenizer(tokenizer, tuple(sorted(eos_token_ids)))
        try:
            grammar = params.lark()
        except ValueError as e:
            raise RowError(f"structured.{params.key}: {one_line(str(e), params.key)}") from None
        self.family = next(_NEXT_FAMILY) % MATCHER_FAMILIES  # which fresh matcher's lexer it shares
        fresh = _fresh_matcher(grammar, tok, self.family)
        if fresh.is_error():
            raise RowError(f"structured.{params.key}: {one_line(fresh.get_error(), params.key)}")
        self.matcher = fresh.deep_copy()
        # (token, accepted, stopped, error): the matcher advanced by ``SlotMasks.start``'s worker, its verdict
        # read there, so that ``consume`` and ``stopped`` need not touch the matcher while the worker masks it
        self.ahead: tuple[int, bool, bool, str] | None = None
        self._stopped: bool | None = None  # the worker's ``is_stopped`` after the last consumed token
        self.words = (tok.vocab_size + 31) // 32
        self.eos = tok.eos_tokens[0]
        self.extra_stops = sorted(i for i in stop_ids if i not in tok.eos_tokens and i < tok.vocab_size)
        self.eos_ids = sorted(i for i in tok.eos_tokens if i < tok.vocab_size) if ignore_eos else []
        self.fixes = bool(self.extra_stops or self.eos_ids)  # whether ``fix_stops`` changes anything

    def consume(self, token: int) -> None:
        """Advance the matcher by one generated token (or take the verdict ``verdict`` kept where
        ``SlotMasks.start``'s worker advanced it by this token already).

        Raises:
            RowError: the grammar rejects it (the mask allowed it only if the matcher is broken) or the
                matcher met a limit (llguidance's parser limits).
        """
        if self.ahead is not None:
            seen, ok, self._stopped, error = self.ahead
            assert seen == token, (self.ahead, token)
            self.ahead = None
        else:
            self._stopped = None
            ok = self.matcher.consume_token(token) and not self.matcher.is_error()
            error = "" if ok else self.matcher.get_error()
        if not ok:
            raise RowError(f"structured output: {one_line(error) or f'token {token} rejected'}")

    def verdict(self, token: int, ok: bool) -> None:
        """Keep the matcher's verdict on ``token``, which it has just consumed (``ok``: ``consume_token``'s
        answer) for ``consume`` (on the thread that advanced it)."""
        ok = ok and not self.matcher.is_error()
        self.ahead = (token, ok, self.matcher.is_stopped(), "" if ok else self.matcher.get_error())

    def continues(self, token: int) -> bool:
        """Take the worker's verdict on ``token`` (``verdict``) where it lets the request go on (accepted, the value
        not complete): True, as ``consume(token)`` followed by a False ``stopped``; else False, the verdict kept
        for ``consume``. The batched loop's shortcut for the usual step."""
        ahead = self.ahead
        if ahead is None or ahead[0] != token or not ahead[1] or ahead[2]:
            return False
        self.consume(token)
        return True

    @property
    def stopped(self) -> bool:
        """The grammar admits no further token: the value is complete."""
        return self.matcher.is_stopped() if self._stopped is None else self._stopped

    def fix_stops(self, row: np.ndarray) -> None:
        """Fix the stop ids of ``row`` (one mask, ``(words,)`` int32, as llguidance filled it) in place:

        - the request's non-EOS stop ids take its EOS bit (allowed where the value may end), unless clearing
          them would leave no token at all (the grammar allows only those stop ids next): then they stay
          allowed and the one sampled ends the row, as ``stop_token_ids`` do without a grammar (vLLM);
        - with ``ignore_eos``, the EOS ids are cleared wherever any other token is allowed, so EOS is taken
          only where the value is complete.
        """
        if not self.fixes:
            return
        bits = row.view(np.uint32)
        if self.extra_stops:
            ok = (bits[self.eos // 32] >> np.uint32(self.eos % 32)) & np.uint32(1)
            fixed = bits.copy()
            for i in self.extra_stops:
                one = np.uint32(1 << (i % 32))
                fixed[i // 32] = fixed[i // 32] | one if ok else fixed[i // 32] & ~one
            if ok or fixed.any():
                bits[:] = fixed
        if self.eos_ids:
            fixed = bits.copy()
            for i in self.eos_ids:
                fixed[i // 32] &= ~np.uint32(1 << (i % 32))
            if fixed.any():
                bits[:] = fixed

    def mask(self) -> np.ndarray:
        """The bitmask of the tokens allowed next, ``(1, words)`` int32 (computed with the GIL released)."""
        out = np.empty((1, self.words), dtype=np.int32)
        llnp.fill_next_token_bitmask(self.matcher, out)
        self.fix_stops(out[0])
        return out


class SlotMasks:
    """The masks of every slot of a batch, computed together by llguidance's thread pool.

    ``start`` hands one step's work to a worker thread and returns at once: advancing each constrained
    slot's matcher by its token, then at once the masks of their next tokens (two llguidance calls back to
    back, each over every slot in parallel with the GIL released), then each matcher's verdict (kept in
    ``Constraint.ahead``) and the masks' distinct rows (``pack``: what goes to the device). The host records
    the step's tokens (``Decoding.record``) meanwhile; ``wait`` returns the masks, and after it
    ``Decoding.settle`` takes the verdicts. Between ``start`` and ``wait``, nothing but the worker may touch
    those slots' matchers.

    While a worker step is in flight the host's Python and the worker share the GIL: the worker needs it
    back after each llguidance call, and Python hands it over only every ``sys.getswitchinterval()``
    seconds (5 ms by default) while the host runs Python. So the first ``start`` lowers the interval to
    ``SWITCH_INTERVAL`` (when it is longer; ``close`` restores it).

    Args:
        B: slots.
    """

    SWITCH_INTERVAL: float | None = 2e-4  # seconds (None: leave Python's interval alone)

    def __init__(self, B: int):
        self.B = B
        self.executor: llguidance.LLExecutor | None = None
        self.bitmask: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._interval: float | None = None  # Python's switch interval before ``start`` lowered it

    def _executor(self) -> llguidance.LLExecutor:
        if self.executor is None:
            self.executor = llguidance.LLExecutor(MASK_THREADS)
        return self.executor

    def start(self, slots, tokens: list[int] | mx.array) -> None:
        """Begin, on the worker thread, advancing every constrained slot's matcher by its token ``tokens[b]``
        (a stop id is left unconsumed: it ends its row), computing the masks of the slots' next tokens
        (``allowed``'s) and keeping the verdicts for ``Constraint.consume``. ``slots``: each slot's
        ``Decoding`` or None, as the step saw them (a list the caller leaves unchanged until ``wait``: the worker
        reads it); ``tokens``: ``(B,)`` ids, a list or a queued device array
        (``mx.async_eval`` called on it, no other thread touching it) that the worker reads when the device has
        computed it (the wait releases the GIL), so the caller need not wait for the device first."""
        if self._job is not None:
            raise RuntimeError("SlotMasks.start: the previous step's masks were not waited for")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline-masks")
            if self.SWITCH_INTERVAL is not None and sys.getswitchinterval() > self.SWITCH_INTERVAL:
                self._interval = sys.getswitchinterval()
                sys.setswitchinterval(self.SWITCH_INTERVAL)
        self._job = self._pool.submit(self._work, slots, tokens)

    def _work(self, slots, tokens) -> tuple | None:
        """Read ``tokens`` (a device array: when the device has it), advance the constrained slots' matchers
        (``_constraints``) by their tokens, fill their masks, then keep the advanced matchers' verdicts; returns the
        bitmask's ``pack`` (all of it made here, off the host's path), or None without a constraint."""
        constraints = _constraints(slots)
        if not constraints:
            return None
        if not isinstance(tokens, list):
            tokens = tokens.tolist()
        feed = [(c, tokens[b]) for c, b in constraints if tokens[b] not in slots[b].stop_ids]
        executor, words = self._executor(), self._bitmask(constraints)
        pairs = [(c.matcher, b) for c, b in constraints]
        oks = llnp.consume_token_par(executor, [(c.matcher, t) for c, t in feed]) if feed else []
        llnp.fill_next_token_bitmask_par(executor, pairs, words)
        for (c, t), ok in zip(feed, oks):
            c.verdict(t, ok)
        self._rows(constraints)
        return pack(self.bitmask)

    def wait(self, vocab: int) -> TokenMask | None:
        """The masks ``start`` began, as ``allowed`` returns them (None: no constrained slot).

        Raises:
            Exception: whatever llguidance raised on the worker thread.
        """
        job, self._job = self._job, None
        return self._finish(job.result(), vocab)

    def close(self) -> None:
        """Stop the worker thread (after the job in flight, if any) and restore Python's switch interval."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._interval is not None:
            sys.setswitchinterval(self._interval)
            self._interval = None

    def allowed(self, slots, vocab: int) -> TokenMask | None:
        """The tokens each slot may take next (every token for a slot without a constraint, or whose matcher
        has stopped or failed: that row ends at its last token), ``(B, vocab)``, or None when no slot has
        one (unconstrained batches pay nothing). ``slots``: each slot's ``Decoding`` or None."""
        constraints = _constraints(slots)
        if not constraints:
            return None
        llnp.fill_next_token_bitmask_par(self._executor(), [(c.matcher, b) for c, b in constraints],
                                         self._bitmask(constraints))
        self._rows(constraints)
        return self._finish(pack(self.bitmask), vocab)

    def _bitmask(self, constraints: list) -> np.ndarray:
        """The ``(B, words)`` int32 bitmask, every bit set (the rows llguidance does not fill allow every token)."""
        words = constraints[0][0].words
        if self.bitmask is None or self.bitmask.shape[1] != words:
            self.bitmask = np.empty((self.B, words), dtype=np.int32)
        self.bitmask.fill(-1)
        return self.bitmask

    def _rows(self, constraints: list) -> None:
        """After llguidance filled ``constraints``' rows: a matcher that has stopped or failed gets every token
        (llguidance gave it EOS alone; its row ends at its last token); the others' stop ids are fixed
        (``Constraint.fix_stops``). A matcher the worker has just advanced is judged by its verdict
        (``Constraint.ahead``), which holds both answers already."""
        bitmask = self.bitmask
        for c, b in constraints:
            if c.ahead is not None:
                ends = not c.ahead[1] or c.ahead[2]  # rejected, failed or stopped
            else:
                ends = c.stopped or c.matcher.is_error()
            if ends:
                bitmask[b] = -1
            elif c.fixes:
                c.fix_stops(bitmask[b])

    def _finish(self, packed: tuple | None, vocab: int) -> TokenMask | None:
        """``pack(bitmask)`` as a ``TokenMask`` (None: no constrained slot)."""
        return None if packed is None else packed_tokens(*packed, vocab)


def _constraints(slots) -> list:
    """``(Constraint, slot)`` of every slot whose request has one, family by family (``MATCHER_FAMILIES``)."""
    return sorted(((d.constraint, b) for b, d in enumerate(slots) if d is not None and d.constraint is not None),
                  key=lambda cb: cb[0].family)


_BIT = mx.arange(32, dtype=mx.uint32)
_UPLOAD: list = []  # the stream the bitmasks are copied to the GPU on (CUDA), made at first use
# Bitmasks of at least this many bytes go to a CUDA device by ``mx.load`` (a copy into device memory), smaller ones
# by ``mx.array`` (CUDA managed memory): ``mx.load``'s host time (the ``.npy`` bytes written and parsed) is what a
# small upload costs, while a large one read by page faults costs the device more (docs/BENCHMARKS.md, 2026-12-06).
LOAD_MIN_BYTES = 256 * 1024


def device_words(bitmask: np.ndarray) -> mx.array:
    """A llguidance bitmask ``(rows, words)`` int32 on the default device as uint32 (on CUDA lazy: the copy runs
    when the array is evaluated).

    On MLX's CUDA backend a bitmask of ``LOAD_MIN_BYTES`` or more goes through ``mx.load`` of its ``.npy`` bytes on
    a stream of its own: MLX's ``Load`` copies host bytes into device memory with ``cudaMemcpyAsync``, where
    ``mx.array(bitmask)`` lands in CUDA managed memory that the GPU then reads by page faults (on an H200, 256
    rows of a 49,152-token vocabulary uploaded and applied: 1.08 ms this way, 1.42 ms by ``mx.array``,
    docs/BENCHMARKS.md); its own stream, so the copy waits for nothing queued on the default one. A smaller one
    (one request's row, a batch's distinct rows) goes by ``mx.array``, whose host time is shorter."""
    words = bitmask.view(np.uint32)
    if words.nbytes < LOAD_MIN_BYTES or not on_cuda():
        return mx.array(words)
    if not _UPLOAD:
        _UPLOAD.append(mx.new_stream(mx.gpu))
    f = io.BytesIO()
    np.save(f, words, allow_pickle=False)
    f.seek(0)
    return mx.load(f, format="npy", stream=_UPLOAD[0])


class TokenMask:
    """The tokens each row may take next, on the device: a llguidance bitmask's words.

    Args:
        words: ``(rows, words)`` uint32; token ``i`` is allowed where bit ``i % 32`` of word ``i // 32`` is set.
        vocab: logits per row (ids from ``32 * words`` on, logits beyond the tokenizer's vocabulary: not
            allowed).
    """

    def __init__(self, words: mx.array, vocab: int):
        self.words, self.vocab = words, vocab

    def bools(self) -> mx.array:
        """``(rows, vocab)`` bool, True where a token is allowed (MLX ops)."""
        w = self.words
        bits = ((w[:, :, None] >> _BIT) & 1).reshape(w.shape[0], -1).astype(mx.bool_)
        n = bits.shape[1]
        if n >= self.vocab:
            return bits[:, : self.vocab]
        return mx.concatenate([bits, mx.zeros((bits.shape[0], self.vocab - n), mx.bool_)], axis=1)

    def apply(self, x: mx.array) -> mx.array:
        """``x`` ``(rows, vocab)`` (any float dtype) as float32 with every token not allowed at -inf: one
        kernel on MLX's CUDA backend (``cuda.mask``), else ``mx.where`` over ``bools()``."""
        call = mask_kernel(x)
        if call is not None:
            return call(x, self.words)
        return mx.where(self.bools(), x.astype(mx.float32), float("-inf"))


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> TokenMask:
    """A llguidance bitmask ``(rows, words)`` int32 on the device as a ``TokenMask`` over ``vocab`` logits a row: one
    row as it is (``device_words``), more as their distinct rows (``pack``, ``packed_tokens``)."""
    if bitmask.shape[0] == 1:
        return TokenMask(device_words(bitmask), vocab)
    return packed_tokens(*pack(bitmask), vocab)


def pack(bitmask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a bitmask ``(n, words)`` int32 and each row's index among them: ``(rows (k, words)
    int32, inverse (n,) int32)`` with ``rows[inverse] == bitmask``. A batch's rows in the same grammar state have the
    same mask (one JSON schema's 16 rows had 5 distinct masks a step, median, on the CPU), so the batch's upload
    shrinks to the distinct ones. Rows are grouped by a sample of their words (every ``words // 64``-th) and each
    checked whole against its group's first; a row that differs elsewhere gets an entry of its own."""
    n, words = bitmask.shape
    step = max(1, words // 64)
    sample = np.ascontiguousarray(bitmask[:, ::step])
    key = sample.view(np.dtype((np.void, sample.shape[1] * sample.itemsize))).ravel()
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rows, inverse = bitmask[first], inverse.reshape(-1).astype(np.int32)
    differ = np.flatnonzero(~(bitmask == rows[inverse]).all(axis=1))
    if len(differ):
        inverse[differ] = len(rows) + np.arange(len(differ), dtype=np.int32)
        rows = np.concatenate([rows, bitmask[differ]])
    return rows, inverse


def packed_tokens(rows: np.ndarray, inverse: np.ndarray, vocab: int) -> TokenMask:
    """``pack``'s ``(rows, inverse)`` on the device in one upload (``device_words``: the rows, then ``inverse`` in
    the words of the rows after them), expanded there to the ``(n, words)`` ``TokenMask`` over ``vocab`` logits."""
    k, words = rows.shape
    n = len(inverse)
    buf = np.zeros((k + -(-n // words), words), dtype=np.int32)
    buf[:k] = rows
    buf[k:].reshape(-1)[:n] = inverse
    up = device_words(buf)
    return TokenMask(mx.take(up[:k], up[k:].reshape(-1)[:n], axis=0), vocab)
