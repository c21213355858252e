"""``FusedDecoder``: the fused CUDA step of the Llama/Qwen2 layer, its weights as the kernels read them, its kernels.

The step's design: ``pipeline.engine.cuda``'s docstring. The kernels' CUDA text: ``kernels/*.cu`` and
``kernels/common.cuh``, read and filled in by ``sources``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import ClassVar, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..cache import _head_dim
from .sources import fill, float_literal, header

ATTN_CHUNK = 128  # keys per attention block (one thread per key)
# The chunk of a model with fewer than ATTN_FEW_HEADS query heads: its grid (chunks x heads) is otherwise a few
# dozen blocks on a GPU of 132 SMs (Gemma-3-1B: 4 heads, 16 blocks over a 512-key window). Gemma-3-1B shape, H200,
# replayed step, one process (docs/BENCHMARKS.md, 2026-12-06): 128 keys 482-504 and 409-459 tok/s, 32 keys 523-557.
ATTN_FEW_HEADS = 8
ATTN_FEW_HEADS_CHUNK = 32


# The attention body's value rows asked of a cache level before the scores (attn.cu's v_prefetch): "none", "L1" or
# "L2" (PTX prefetch.global.L1 / .L2).
ATTN_V_PREFETCH = "none"


def attn_chunk(n_heads: int) -> int:
    """Keys (and threads) per block of ``kernels/attn.cu`` for a model of ``n_heads`` query heads."""
    return ATTN_FEW_HEADS_CHUNK if n_heads < ATTN_FEW_HEADS else ATTN_CHUNK
WARPS_PER_BLOCK = 8  # per GEMV block of 256 threads
# A GEMV over at least this many inputs, staged as is ("copy") from quantized weights, splits each row over
# its block's 8 warps (gemv.cu's body_split), SPLIT_UNITS rows a block: a long row (the down projection's)
# otherwise leaves too few warps, each with too few loads in flight, to fill the GPU. 3,584: the Qwen2.5-7B
# shape's o projection splits too (H200, replayed step 302.4 / 308.1 -> 312.3 / 313.3 tok/s, docs/BENCHMARKS.md).
SPLIT_MIN_IN = 3584
SPLIT_UNITS = 2
MAX_SMEM_BYTES = 48 * 1024  # static shared memory limit per block (CUDA)
# Chunks of every row a lane has in flight (pl_rows_dot's UNROLL). 1 rather than 2: fewer registers, more
# warps an SM; Qwen2.5-7B shape on an H200, replayed step 277.8 -> 304.4 tok/s (docs/BENCHMARKS.md, 2026-12-03).
GEMV_UNROLL = 1
# The q/k/v kernel's (qkv.cu) unrolling of the same loop, None: GEMV_UNROLL. A lane of it reads hidden / 1,024 chunks
# of its two rows (4-bit: Llama-3.2-1B 2, Qwen2.5-7B 3.5), so at 1 their loads are that many rounds of latency.
QKV_UNROLL: int | None = None
# The q/k/v kernel asks L2 for the layer's filled cache rows before its own work, so the attention kernel after it
# finds them there (common.cuh's pl_prefetch_kv; the one-kernel layer's counterpart: LAYER_PREFETCH_KV).
QKV_PREFETCH_KV = False
# A GEMV's grid is capped at this many blocks per SM (its warps then loop over the row groups: gemv.cu), None: one
# warp per row group. None: capped at 2, 4 or 8 the warp-per-row kernels measured slower or no faster (Qwen2.5-7B
# shape, H200, replayed step 305.6 uncapped, 258.5 / 295.3 / 308.8 capped).
GEMV_BLOCKS_PER_SM: int | None = None
# GEMV modes run on tensor cores where the weights allow (4-bit, float16: gemv.cu's body_mma), and the quantization
# groups each warp of such a kernel loads before it uses the first. The warp-per-row gate/up kernel issued an
# instruction in 70% of its cycles (Nsight Compute, Qwen2.5-7B shape: ~7.5 instructions a 4-bit value, 80 registers);
# on tensor cores ~2.3. Gate/up only: replayed 7B step 305.8 / 311.1 -> 330.4 / 333.1 tok/s (H200, docs/BENCHMARKS.md);
# the o/down (224 blocks of 16 rows: too few) and vocab projections measured slower or no faster there. Gemma 3's
# "geglu" (gate/up after the residual step) and "res_logits" (its vocabulary projection) can run there too.
GEMV_MMA_MODES: tuple[str, ...] = ("swiglu",)
MMA_GROUPS_IN_FLIGHT = 4
# The tensor-core GEMV's grid cap (blocks a SM): its blocks stage x for 16 rows only, so uncapped the staging
# outweighs the rows (Qwen2.5-7B shape, H200: gate/up 57.7 us uncapped, 45.9 at 4 a SM, 49.4 at 8, 68.3 at 2).
# None: uncapped.
MMA_BLOCKS_PER_SM: int | None = 4
# A Llama/Qwen2 layer as ONE kernel (kernels/layer.cu: the five kernels' bodies as phases between grid barriers), so
# the host launches one kernel a layer, not five; ``FusedDecoder.one_kernel_layers``. LAYER_BLOCKS_PER_SM: its
# grid, blocks of 256 threads an SM (1: every block resident whatever its registers, as the grid barrier needs).
# LAYER_ATTN_CHUNK: keys a block of its attention phase (one thread a key, so the block's 256 threads).
# On by default for layers of at most ONE_KERNEL_MAX_LAYER_BYTES of weights, where launches bound the step: H200,
# replayed, 4-bit g64, prompt 512, alternated in one process (docs/BENCHMARKS.md, 2026-12-04 (night)): SmolLM2-135M
# (1.8 MB a layer) 448 / 515 -> 894 / 907 tok/s; Llama-3.2-1B (34 MB) 829-984 against 966 / 972 at 2 blocks an SM
# (no clear win); Qwen2.5-7B (233 MB) 344 / 349 -> 274 (2 an SM) / 299 (3): too few warps for its GEMVs' loads.
ONE_KERNEL_LAYERS = True
ONE_KERNEL_MAX_LAYER_BYTES = 8 * 2**20
LAYER_BLOCKS_PER_SM = 1  # SmolLM2-135M: 885-892 tok/s at 1, 837-847 at 2
LAYER_ATTN_CHUNK = 256
# The one-kernel layer's attention phase: "block", attn.cu's body, a block a chunk of LAYER_ATTN_CHUNK keys; "warp",
# attn.cu's warp_body, a warp a chunk of 32 keys (head sizes 32, 64, 128, 256; others run "block").
LAYER_ATTN = "block"
LAYER_WARP_CHUNK = 32
# LAYER_PREFETCH: the weights the grid asks L2 for when the layer starts (layer.cu's prefetch): "none", "ogd" (the o,
# gate/up and down projections', which the later phases read), "all" (the q/k/v projection's too). "all": H200,
# SmolLM2-135M shape, replayed step alternated in one process, none 874-934 tok/s, "all" 987-1,025, "ogd" with the next
# layer's q/k/v weights too 980-999 (gate/up 4.3 -> 3.8 us, down 3.0 -> 2.5; docs/BENCHMARKS.md, 2026-12-06 (night)).
LAYER_PREFETCH = "all"
# LAYER_PREFETCH_KV: the layer's filled cache rows (keys and values) asked of L2 too, when the layer starts, so the
# attention phase finds them there (layer.cu's prefetch_kv).
LAYER_PREFETCH_KV = False
# The grid barrier between the one-kernel layer's phases (common.cuh): "gen" pl_grid_sync (a count and a generation
# word, the last block to arrive resets one and advances the other), "flip" pl_grid_sync_flip<false> (one word whose
# top bit the last arrival flips, fences as cooperative_groups'), "flip-ra" pl_grid_sync_flip<true> (the same with a
# release add and acquire loads instead of the fences). flip-ra: H100, SmolLM2-135M shape, replayed step alternated in
# one process, gen 835 / 879 tok/s, flip-ra 945 / 949; the layer 27.8-28.2 us a call against 31.0-35.8 (phase trace,
# docs/BENCHMARKS.md, 2026-12-06 (night)).
LAYER_BARRIER = "flip-ra"
LAYER_SYNCS = {"gen": "pl_grid_sync(bar)", "flip": "pl_grid_sync_flip<false>(bar + 48)",
               "flip-ra": "pl_grid_sync_flip<true>(bar + 48)"}


@functools.cache
def sm_count() -> int | None:
    """Streaming multiprocessors of CUDA device 0 (the driver's ``cuDeviceGetAttribute``), or None where the
    driver library cannot be read."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, n = ctypes.c_int(), ctypes.c_int()
    # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16 (cuda.h)
    if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(dev), 0) or cu.cuDeviceGetAttribute(ctypes.byref(n), 16, dev):
        return None
    return n.value


def gemv_blocks(needed: int, per_sm: int | None) -> int:
    """Blocks of a GEMV launch that has ``needed`` blocks' worth of row groups: capped at ``per_sm`` (None: no cap)
    times the SM count (the kernels loop over the rest)."""
    sms = sm_count() if per_sm else None
    return min(needed, per_sm * sms) if sms else needed


def units_per_warp(rows: int, mode: str) -> int:
    """Output rows (row pairs for "swiglu") one warp computes: more for large projections, so x is
    staged and read once for several weight rows (fewer x reads per weight byte, more loads in flight),
    one or two for small ones, so enough blocks exist to occupy the GPU."""
    if mode == "swiglu":
        return 2 if rows >= 16384 else 1
    return 4 if rows >= 16384 else 2


class GemvSource(NamedTuple):
    """A GEMV's CUDA body (``kernels/gemv.cu`` filled in) and what launching it needs."""

    name: str  # the kernel's name
    source: str
    inputs: list[str]  # input names, in order
    outputs: list[str]
    warps: int  # warps that cover its rows once
    n_out: int  # output rows
    mma: bool  # on tensor cores (body_mma)


class Proj:
    """One projection's weights as the kernels read them: ``bits`` 0 (dense), 4 or 8."""

    def __init__(self, layer: nn.Module):
        self.bias = layer.get("bias") if isinstance(layer, nn.Module) else None
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            self.bits, self.group_size = layer.bits, layer.group_size
            self.arrays = [layer.weight, layer.scales, layer.biases]
            self.out_dim = layer.weight.shape[0]
            self.in_dim = layer.weight.shape[1] * 32 // layer.bits
        else:
            self.bits, self.group_size = 0, 1
            self.arrays = [layer.weight]
            self.out_dim, self.in_dim = layer.weight.shape

    def problem(self, dtype: mx.Dtype) -> str | None:
        """Why the GEMV cannot read these weights, or None."""
        if self.bits not in (0, 4, 8):
            return f"{self.bits}-bit weights"
        if self.bits and (getattr(self.arrays[1], "dtype", None) != dtype or len(self.arrays) != 3
                          or self.arrays[2] is None):
            return "quantized weights without affine scales/biases of the compute dtype"
        if not self.bits and self.arrays[0].dtype != dtype:
            return f"dense weights of {self.arrays[0].dtype}, compute dtype {dtype}"
        vals = 128 // self.bits if self.bits else 16 // dtype.size
        if self.in_dim % vals or (self.bits and self.group_size % vals):
            return f"input size {self.in_dim} / group size {self.group_size} not a multiple of {vals}"
        if self.in_dim * dtype.size > MAX_SMEM_BYTES - 1024:
            return f"input size {self.in_dim} too large for one block's shared memory"
        return None

    def names(self, prefix: str = "") -> list[str]:
        """The kernel's input names for ``arrays`` (``prefix`` tells two projections of a kernel apart)."""
        return [prefix + n for n in (["w", "s", "b"] if self.bits else ["w"])]

    def vals(self, dtype: mx.Dtype) -> int:
        """Input values one lane's 16-byte weight load covers."""
        return 128 // self.bits if self.bits else 16 // dtype.size

    def rows_dot(self, r: int, prefix: str = "", acc: str = "acc", split: bool = False,
                 unroll: int | None = None) -> str:
        """CUDA statement: the warp's dot products of rows ``rows[0..r)`` with ``xs`` into ``acc``
        (``split``: the block's share of them with ``x`` in global memory, ``calls.cu``'s rows_dot_split), the
        chunk loop unrolled ``unroll`` times (None: ``GEMV_UNROLL``)."""
        names = self.names(prefix)
        unroll = unroll or GEMV_UNROLL
        if self.bits:
            w, s, b = names
            return fill("calls.cu", "rows_dot_split" if split else "rows_dot_quantized", bits=self.bits,
                        group_size=self.group_size, in_dim=self.in_dim, rows=r, w=w, s=s, b=b, acc=acc,
                        unroll=unroll)
        return fill("calls.cu", "rows_dot_dense", in_dim=self.in_dim, rows=r, w=names[0], acc=acc, unroll=unroll)


def projs_problem(groups: list[list[Proj]], what: str) -> str | None:
    """Why one kernel cannot read these projections together, or None: a group (projections read by one
    kernel's shared loop, e.g. q/k/v) of different quantization, or any projection with a bias; ``what``
    names the groups in the message."""
    if any(len({(p.bits, p.group_size) for p in group}) > 1 for group in groups):
        return f"{what} projections of different quantization"
    if any(p.bias is not None for group in groups for p in group):
        return "biased projections"
    return None


def rope_table(rope: nn.Module, head_dim: int) -> tuple[mx.array, float, bool]:
    """``(inverse frequencies (head_dim/2,) float32, position scale, traditional)`` of a RoPE module
    (``nn.RoPE``: ``base ** (-2j / dims)``, positions times ``scale``; ``Llama3RoPE``: ``1 / freqs``)."""
    if rope.dims != head_dim:
        raise ValueError("partial RoPE")
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        return (1.0 / freqs.astype(mx.float32)).astype(mx.float32), 1.0, rope.traditional
    j = mx.arange(0, head_dim, 2, dtype=mx.float32)
    inv = mx.power(mx.array(rope.base, mx.float32), -j / head_dim)
    return inv.astype(mx.float32), float(rope.scale), rope.traditional


class FusedDecoder:
    """The fused decode step of one Llama-family or Qwen2 model (see ``pipeline.engine.cuda``);
    ``Gemma3Decoder`` is the Gemma 3 variant. Build one with ``decoder_for(model)``.

    ``step(token, pos, n_ctx, caches)``: ``token`` ``(1,)`` integer array, ``pos`` ``(1,)`` int32 array
    (the token's position = positions already in the caches), ``n_ctx`` the same position as a host int
    (sizes the attention grid) or None (the grid covers the caches' capacity, so nothing in the step
    changes from token to token and ``mx.compile`` can replay it: ``Engine.compile_fused``) -> logits ``(1, vocab)``
    in the compute dtype. Writes the token's keys
    and values in place into each cache's buffers: slot ``pos`` of a ``KVCache``, slot
    ``pos % max_size`` of a ``RotatingKVCache`` (``pipeline.engine.cache``: the ring's layout). The buffers
    must be materialized, row-contiguous and long enough (``prepare``).

    ``one_kernel_layers`` (bool, settable): each layer runs as one kernel (``kernels/layer.cu``; True by default
    where ``layer_blocker`` allows and ``layer_bytes`` <= ``ONE_KERNEL_MAX_LAYER_BYTES``). Its attention splits the
    keys in chunks of 256, not 128, so its logits match the five kernels' to float rounding, not bitwise.

    Raises:
        ValueError (constructor): the model is not supported (``blocker`` gives the reason).
    """

    # The HF model_type of the families whose layer this class runs (Qwen 3's and Gemma 3's, with per-head
    # q/k RMSNorms, are subclasses': ``Qwen3Decoder``, ``Gemma3Decoder``).
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")

    def __init__(self, model):
        reason = self.blocker(model)
        if reason:
            raise ValueError(reason)
        args = model.args
        inner = model.model
        self.dtype = inner.norm.weight.dtype
        self.hidden = args.hidden_size
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        attn0 = inner.layers[0].self_attn
        self.head_dim = _head_dim(model)
        self.scale = attn0.scale
        self.eps = args.rms_norm_eps
        self.embed = Proj(inner.embed_tokens)
        self.head = Proj(model.lm_head) if "lm_head" in model else self.embed
        self.final_norm = inner.norm.weight
        self.embed_scale: float | None = None
        self.layers = [self._read_layer(layer) for layer in inner.layers]
        mx.eval([v for lay in self.layers for v in lay.values() if isinstance(v, mx.array)])
        self._kernels: dict = {}
        self.attn_chunk = attn_chunk(self.n_heads)
        self._scratch = None
        self._counts = mx.zeros((self.n_heads,), mx.int32)
        # one_kernel_layers: kernels/layer.cu's state (the grid barrier's words) and the vectors
        # its phases pass on (q, the attention output, the residual stream after attention, the MLP activation)
        self.one_kernel_layers = (ONE_KERNEL_LAYERS and self.layer_bytes() <= ONE_KERNEL_MAX_LAYER_BYTES
                                  and self.layer_blocker() is None)
        # 64 words: the barriers' words (common.cuh: pl_grid_sync's [0] and [32], 128 bytes apart; pl_grid_sync_flip's
        # [48]), and more than 8 bytes, which MLX's CUDA allocator would place in its small pool, managed memory advised
        # read-mostly: there the barrier's atomics cost ~5 us each (H200: a SmolLM2-135M layer 3.1 ms, not microseconds)
        self._barrier = mx.zeros((64,), mx.uint32)
        # benchmarks only: a uint64 array of 16 words a block of the layer's grid that kernels/layer.cu adds its
        # phases' and barriers' clock cycles to (its trace section), or None (no trace compiled in)
        self.layer_trace: mx.array | None = None
        inter = max(lay["gu"].out_dim // 2 for lay in self.layers) if "gu" in self.layers[0] else 0
        self._work = mx.zeros((2 * self.n_heads * self.head_dim + self.hidden + inter,), self.dtype)
        # kernels/qkv_norm.cu's state: each q/k/v head's projected rows (float32), and per head the count of its
        # blocks done (64 words at least, out of MLX's small pool as the barrier above)
        heads = self.n_heads + 2 * self.n_kv_heads
        self._qkv_rows = mx.zeros((heads * self.head_dim,), mx.float32)
        self._arrivals = mx.zeros((max(64, heads),), mx.uint32)
        mx.eval(self._barrier, self._work, self._qkv_rows, self._arrivals)

    # -- what the kernels need of a model -------------------------------------------------------------

    @classmethod
    def blocker(cls, model) -> str | None:
        """Why this class cannot run ``model``, or None: a family not in ``model_types``, the compute
        dtype, head size, RoPE variant, or weights the GEMV cannot read (``Proj.problem``)."""
        family = model.args.model_type
        if family not in cls.model_types:
            return f"model family {family} has no fused step"
        inner = model.model
        dtype = inner.norm.weight.dtype
        if dtype not in (mx.float16, mx.bfloat16, mx.float32):
            return f"compute dtype {dtype}"
        attn0 = inner.layers[0].self_attn
        head_dim = _head_dim(model)
        # below 32 the fused step's logits were wrong on an H200 (head_dim 16: 53% off, tests/test_fused_gpu.py)
        if head_dim % 8 or head_dim < 32 or head_dim > 1024 or attn0.n_heads % attn0.n_kv_heads:
            return f"head_dim {head_dim}"
        why = cls._shape_problem(model, dtype, head_dim)
        if why:
            return why
        projs = [Proj(inner.embed_tokens)] + ([Proj(model.lm_head)] if "lm_head" in model else [])
        for layer in inner.layers:
            a = layer.self_attn
            if type(a.rope).__name__ not in ("RoPE", "Llama3RoPE") or a.rope.dims != head_dim:
                return "RoPE variant"
            why, layer_projs = cls._layer_projs(layer)
            if why:
                return why
            projs += layer_projs
        for p in projs:
            why = p.problem(dtype)
            if why:
                return why
        if projs[0].bits and projs[0].group_size > model.args.hidden_size:
            return "embedding group size"
        return None

    @staticmethod
    def _shape_problem(model, dtype: mx.Dtype, head_dim: int) -> str | None:
        """Why the model's sizes do not fit this class's kernels (beyond ``Proj.problem``), or None."""
        return None

    @staticmethod
    def _layer_projs(layer) -> tuple[str | None, list[Proj]]:
        """``(why the layer cannot run here or None, its projections)``: fused q/k/v and gate/up
        projections (``pipeline.models.base.fuse_projections``), no o/MLP biases."""
        a, m = layer.self_attn, layer.mlp
        if "qkv_proj" not in a or "gate_up_proj" not in m:
            return "q/k/v or gate/up projections are not fused (their weights differ in kind)", []
        if "bias" in m.down_proj or "bias" in a.o_proj or "bias" in m.gate_up_proj:
            return "biased o/MLP projections", []
        return None, [Proj(a.qkv_proj), Proj(a.o_proj), Proj(m.gate_up_proj), Proj(m.down_proj)]

    def _read_layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        inv, pscale, trad = rope_table(a.rope, self.head_dim)
        return {"in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                **self._qkv_entries(a), "o": Proj(a.o_proj), "gu": Proj(m.gate_up_proj), "down": Proj(m.down_proj),
                "inv_freq": inv, "pos_scale": pscale, "traditional": trad}

    @staticmethod
    def _qkv_entries(attn) -> dict:
        """The layer entries of the q/k/v projection: ``{"qkv": Proj}`` of the fused matrix."""
        return {"qkv": Proj(attn.qkv_proj)}

    # -- kernels --------------------------------------------------------------------------------------

    def _kernel(self, key, make):
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = make()
        return k

    def _qkv_kernel(self, qkv: Proj, trad: bool, pscale: float, win: int):
        """``kernels/qkv.cu`` for this layer's shapes, and its number of rotation pairs (one warp each)."""

        def make():
            src, names, pairs = self._qkv_source(qkv, trad, pscale, win, QKV_PREFETCH_KV)
            return mx.fast.cuda_kernel(name="pl_qkv", input_names=names, output_names=["q"], source=src,
                                       header=header()), pairs

        return self._kernel(("qkv", qkv.bits, qkv.group_size, qkv.in_dim, qkv.out_dim, trad, pscale,
                             qkv.bias is not None, win, GEMV_UNROLL, QKV_UNROLL, QKV_PREFETCH_KV), make)

    def _prefetch_kv(self, win: int) -> str:
        """CUDA statement: the layer's filled cache rows asked of L2 by the whole grid (calls.cu's prefetch_kv)."""
        return fill("calls.cu", "prefetch_kv", window=win, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)

    def _qkv_source(self, qkv: Proj, trad: bool, pscale: float, win: int,
                    prefetch_kv: bool = False) -> tuple[str, list[str], int]:
        """``(kernels/qkv.cu's body filled in, its input names, its rotation pairs)``; ``prefetch_kv``: the body
        first asks L2 for the layer's filled cache rows (``_prefetch_kv``)."""
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        has_bias = qkv.bias is not None
        pairs = (H + 2 * KVH) * D // 2
        bias = [fill("qkv.cu", "bias", y=f"y{i}", row=f"r{i}") if has_bias else "" for i in (0, 1)]
        src = fill("qkv.cu", "body", hidden=self.hidden, head_dim=D, n_heads=H, n_kv_heads=KVH, window=win,
                   vals=qkv.vals(self.dtype), eps=float_literal(self.eps), pairs=pairs, traditional=int(trad),
                   prefetch_kv=self._prefetch_kv(win) if prefetch_kv else "",
                   rows_dot=qkv.rows_dot(2, unroll=QKV_UNROLL), bias0=bias[0], bias1=bias[1], pos_scale=float_literal(pscale))
        names = ["x", "nw", *qkv.names(), *(["bias"] if has_bias else []), "inv_freq", "pos", "kc", "vc"]
        return src, names, pairs

    # Rows of a q/k/v head each warp of kernels/qkv_norm.cu computes (the head's rows are spread over
    # head_dim / (8 * QKV_NORM_UNITS) blocks).
    QKV_NORM_UNITS = 2

    def _qkv_norm_kernel(self, lay: dict, res: bool, win: int):
        """``kernels/qkv_norm.cu``: the q/k/v step of a layer with per-head q/k RMSNorms (Gemma 3, Qwen 3) for this
        layer's shapes, and its blocks (256 threads each: ``head_dim / (8 * QKV_NORM_UNITS)`` per q, k or v head).
        The layer's projections: ``lay["qkv"]``, one fused q/k/v ``Proj`` (rows: q heads, k heads, v heads), or
        ``lay["q"]``, ``["k"]``, ``["v"]`` of one quantization (``qkv_arrays``); ``res``: the kernel starts with
        Gemma 3's residual step of the previous layer (prologue "res", else "norm")."""
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        fused = lay.get("qkv")
        projs = [fused] if fused is not None else [lay["q"], lay["k"], lay["v"]]
        trad, pscale = lay["traditional"], lay["pos_scale"]
        pre = "res" if res else "norm"
        units = self.QKV_NORM_UNITS if D % self.QKV_NORM_UNITS == 0 else 1
        blocks = (H + 2 * KVH) * -(-D // (WARPS_PER_BLOCK * units))

        def make():
            def head_rows(proj: Proj, prefix: str, first: str) -> str:
                return fill("qkv_norm.cu", "head_rows", first=first, rows_dot=proj.rows_dot(units, prefix))

            if fused is not None:  # head h's rows start at row h * head_dim of the fused matrix
                rows = [head_rows(fused, "", "head")] * 3
                weights = fused.names()
            else:
                rows = [head_rows(lay["q"], "q", "head"), head_rows(lay["k"], "k", "head - H"),
                        head_rows(lay["v"], "v", "head - H - KVH")]
                weights = [*lay["q"].names("q"), *lay["k"].names("k"), *lay["v"].names("v")]
            src = fill("qkv_norm.cu", "body", hidden=self.hidden, head_dim=D, n_heads=H, n_kv_heads=KVH,
                       units=units, window=win, prologue=self._prologue(pre, projs[0].vals(self.dtype)),
                       q_rows=rows[0], k_rows=rows[1], v_rows=rows[2], eps=float_literal(self.eps),
                       traditional=int(trad), pos_scale=float_literal(pscale))
            names = [*self.PROLOGUE_INPUTS[pre], *weights, "qn", "kn", "inv_freq", "pos", "kc", "vc", "qkv_rows",
                     "arrivals"]
            kern = mx.fast.cuda_kernel(name="pl_qkv_norm", input_names=names,
                                       output_names=["q", "hout"] if res else ["q"], source=src, header=header())
            return kern, blocks

        sig = tuple((p.bits, p.group_size, p.in_dim, p.out_dim) for p in projs)
        return self._kernel(("qkv_norm", sig, trad, pscale, res, win, GEMV_UNROLL, units), make)

    def _qkv_norm(self, lay: dict, front: list, pos: mx.array, cache, res: bool = False):
        """Launch ``_qkv_norm_kernel``: ``front`` the prologue's inputs (``PROLOGUE_INPUTS``: "res" with ``res``,
        else "norm"); the query ``(n_heads * head_dim,)``, and with ``res`` also the new residual stream
        ``(hidden,)``; the token's key and value written into ``cache``."""
        kern, blocks = self._qkv_norm_kernel(lay, res, cache.max_size or 0)
        inputs = [*front, *self.qkv_arrays(lay), lay["q_norm"], lay["k_norm"], lay["inv_freq"], pos, cache.keys,
                  cache.values, self._qkv_rows, self._arrivals]
        return self._launch(kern, inputs, blocks, self.n_heads * self.head_dim, res=res)

    @staticmethod
    def qkv_arrays(lay: dict) -> list:
        """The q/k/v weight arrays of a layer, in ``_qkv_norm_kernel``'s input order."""
        if lay.get("qkv") is not None:
            return list(lay["qkv"].arrays)
        return [*lay["q"].arrays, *lay["k"].arrays, *lay["v"].arrays]

    def _attn_kernel(self, win: int):
        """Attention of each head's query over the cache's filled slots: ``0..pos`` (full cache) or
        ``0..min(pos + 1, win) - 1`` (a ring of ``win`` slots: exactly the query's window);
        ``kernels/attn.cu``."""

        def make():
            return mx.fast.cuda_kernel(name="pl_attn", input_names=["q", "kc", "vc", "pos", "scratch", "counts"],
                                       output_names=["o"], source=self._attn_source(win, self.attn_chunk),
                                       header=header())

        return self._kernel(("attn", win, self.attn_chunk, ATTN_V_PREFETCH), make)

    def _attn_source(self, win: int, chunk: int) -> str:
        """``kernels/attn.cu``'s body for blocks of ``chunk`` keys (and threads)."""
        pre = "" if ATTN_V_PREFETCH == "none" else fill("attn.cu", "v_prefetch",
                                                         l1=str(ATTN_V_PREFETCH == "L1").lower())
        return fill("attn.cu", "body", head_dim=self.head_dim, chunk=chunk, group=self.n_heads // self.n_kv_heads,
                    window=win, scale=float_literal(self.scale), v_prefetch=pre)

    # GEMV modes: (prologue staging x, epilogue storing the rows).
    # prologue "copy": x as is; "norm": rms_norm(x, nw); "res" (Gemma 3): hout = h + rms_norm(x, wpost),
    # then rms_norm(hout, nw); "res_final": the same without writing hout.
    # epilogue "plain": out = T(W x); "residual": out = T(T(W x) + r); "swiglu": out[i] = silu(T(W x)[i]) *
    # T(W x)[i + n] (gate and up rows of one fused matrix); "geglu": out = gelu_approx(T(G x)) * T(U x)
    # (two matrices, the second passed as ``proj2``); MLX's rounding after each op.
    GEMV_MODES = {
        "residual": ("copy", "residual"),
        "swiglu": ("norm", "swiglu"),
        "norm": ("norm", "plain"),
        "plain": ("copy", "plain"),
        "geglu": ("res", "geglu"),
        "res_logits": ("res_final", "plain"),
    }
    # The inputs each prologue reads, in the kernels' order (the weights follow).
    PROLOGUE_INPUTS = {"copy": ["x"], "norm": ["x", "nw"], "res": ["x", "h", "wpost", "nw"],
                       "res_final": ["x", "h", "wpost", "nw"]}

    def _prologue(self, pre: str, vals: int) -> str:
        """CUDA statements staging the GEMV's input in ``xs`` (see ``GEMV_MODES``; ``kernels/calls.cu``)."""
        eps = float_literal(self.eps)
        if pre in ("copy", "norm"):
            return fill("calls.cu", "load_x", norm=str(pre == "norm").lower(), vals=vals,
                        weight="nw" if pre == "norm" else "x", eps=eps)
        write = pre == "res"
        return fill("calls.cu", "load_x_res", vals=vals, clip=str(self.dtype == mx.float16).lower(),
                    write=str(write).lower(), eps=eps, hout="hout" if write else "(T*)nullptr")

    def _gemv_kernel(self, proj: Proj, mode: str, proj2: Proj | None = None):
        """``kernels/gemv.cu`` for ``mode`` and these weights: ``(kernel, its warps, its output rows, whether it runs on
        tensor cores)``."""
        mma = self._mma_problem(proj, mode) is None

        def make():
            g = self._gemv_source(proj, mode, proj2)
            return mx.fast.cuda_kernel(name=g.name, input_names=g.inputs, output_names=g.outputs, source=g.source,
                                       header=header()), g.warps, g.n_out, g.mma

        sig = lambda p: None if p is None else (p.bits, p.group_size, p.in_dim, p.out_dim)  # noqa: E731
        return self._kernel(("gemv", mode, sig(proj), sig(proj2), SPLIT_MIN_IN, SPLIT_UNITS, GEMV_UNROLL, mma,
                             MMA_GROUPS_IN_FLIGHT), make)

    def _gemv_source(self, proj: Proj, mode: str, proj2: Proj | None = None) -> GemvSource:
        """``kernels/gemv.cu``'s body for ``mode`` and these weights (on tensor cores where ``_mma_problem`` allows)."""
        pre, post = self.GEMV_MODES[mode]
        if self._mma_problem(proj, mode) is None:
            return self._gemv_mma_source(proj, mode, proj2)
        pair = post in ("swiglu", "geglu")
        n_out = proj.out_dim // 2 if post == "swiglu" else proj.out_dim
        split = pre == "copy" and bool(proj.bits) and proj.in_dim >= SPLIT_MIN_IN  # "copy": plain or residual
        units = SPLIT_UNITS if split else units_per_warp(2 * n_out if pair else n_out, "swiglu" if pair else mode)
        r = 2 * units if post == "swiglu" else units
        if post == "geglu":
            dots = fill("gemv.cu", "dots_geglu", n_rows=r, gate_dot=proj.rows_dot(r, "g"),
                        up_dot=proj2.rows_dot(r, "u", "acc2"))
        else:
            dots = proj.rows_dot(r, split=split)
        src = fill("gemv.cu", "body_split" if split else "body", in_dim=proj.in_dim, n_out=n_out,
                   units=units, prologue=self._prologue(pre, proj.vals(self.dtype)), n_rows=r,
                   row_index=fill("gemv.cu", "row_index_pair" if post == "swiglu" else "row_index"),
                   dots=dots, store=fill("gemv.cu", f"store_{post}"))
        names = list(self.PROLOGUE_INPUTS[pre])
        names += [*proj.names("g"), *proj2.names("u")] if post == "geglu" else proj.names()
        names += ["r"] if post == "residual" else []
        outs = ["out", "hout"] if pre == "res" else ["out"]
        warps = -(-n_out // units) * (WARPS_PER_BLOCK if split else 1)
        return GemvSource(f"pl_gemv_{mode}" + ("_split" if split else ""), src, names, outs, warps, n_out, False)

    def _mma_problem(self, proj: Proj, mode: str) -> str | None:
        """Why mode ``mode`` of ``proj`` does not run on tensor cores (``_gemv_mma_source``), or None. Geglu's up
        projection is quantized as its gate (the blocker's ``projs_problem`` refuses a model where they differ)."""
        pre, post = self.GEMV_MODES[mode]
        if mode not in GEMV_MMA_MODES:
            return f"mode {mode} not in GEMV_MMA_MODES"
        if proj.bits != 4 or self.dtype != mx.float16:
            return "not 4-bit weights in float16"
        if pre not in ("copy", "norm", "res", "res_final") or post not in ("swiglu", "geglu", "plain", "residual"):
            return f"mode {mode}"
        if proj.group_size not in (32, 64, 128):
            return f"group size {proj.group_size}"
        return None

    def _gemv_mma_source(self, proj: Proj, mode: str, proj2: Proj | None = None) -> GemvSource:
        """``kernels/gemv.cu``'s body_mma for ``mode`` (see ``_mma_problem``): 8 warps a block of 16 rows (or 8 swiglu
        / geglu row pairs; geglu's up rows from ``proj2``)."""
        pre, post = self.GEMV_MODES[mode]
        pair = post in ("swiglu", "geglu")
        n_out = proj.out_dim // 2 if post == "swiglu" else proj.out_dim
        eps = float_literal(self.eps)
        if pre in ("res", "res_final"):
            write = pre == "res"
            prologue = fill("calls.cu", "load_x_res_mma", clip=str(self.dtype == mx.float16).lower(), eps=eps,
                            write=str(write).lower(), hout="hout" if write else "(T*)nullptr")
        else:
            prologue = fill("calls.cu", "load_x_mma", norm=str(pre == "norm").lower(),
                            weight="nw" if pre == "norm" else "x", eps=eps)
        w0 = proj.names("g") if post == "geglu" else proj.names()
        w1 = proj2.names("u") if post == "geglu" else w0
        src = fill("gemv.cu", "body_mma", in_dim=proj.in_dim, n_out=n_out, group_size=proj.group_size,
                   pair=int(pair), prologue=prologue, pair_row="r0" if post == "geglu" else "r0 + N",
                   w0=w0[0], s0=w0[1], b0=w0[2], w1=w1[0], s1=w1[1], b1=w1[2],
                   groups_in_flight=MMA_GROUPS_IN_FLIGHT, store=fill("gemv.cu", f"store_{post}"))
        names = [*self.PROLOGUE_INPUTS[pre], *w0, *(w1 if post == "geglu" else []),
                 *(["r"] if post == "residual" else [])]
        outs = ["out", "hout"] if pre == "res" else ["out"]
        return GemvSource(f"pl_gemv_{mode}_mma", src, names, outs, -(-n_out // (8 if pair else 16)) * WARPS_PER_BLOCK,
                          n_out, True)

    def _embed_kernel(self):
        """``kernels/embed.cu`` for the embedding's layout (and Gemma's scale)."""
        e = self.embed

        def make():
            n = self.hidden
            if e.bits:
                per = 32 // e.bits
                val = fill("embed.cu", "value_quantized", groups=n // e.group_size, group_size=e.group_size,
                           words=n // per, per_word=per, bits=e.bits, mask=(1 << e.bits) - 1)
            else:
                val = fill("embed.cu", "value_dense", hidden=n)
            if self.embed_scale is not None:  # Gemma 3: the embedding (in T) times the scale (in T)
                val = fill("embed.cu", "value_scaled", value=val, scale=float_literal(self.embed_scale))
            src = fill("embed.cu", "body", hidden=n, value=val)
            return mx.fast.cuda_kernel(name="pl_embed", input_names=["ids", *e.names()], output_names=["out"],
                                       source=src, header=header())

        return self._kernel(("embed",), make)

    # -- one kernel a layer (kernels/layer.cu) -------------------------------------------------------

    def layer_bytes(self) -> int:
        """Bytes of the largest layer's projection weights (packed words, scales, biases), as a step reads them."""
        return max(sum(a.nbytes for k in ("qkv", "q", "k", "v", "o", "gu", "gate", "up", "down") if k in lay
                       for a in lay[k].arrays) for lay in self.layers)

    def layer_blocker(self) -> str | None:
        """Why this decoder cannot run a layer as one kernel (``one_kernel_layers``), or None: only the Llama/Qwen2
        layer of this class (not Gemma 3's or Qwen 3's), and the SM count must be known (the grid barrier needs
        every block resident)."""
        if type(self)._query is not FusedDecoder._query or type(self).step is not FusedDecoder.step:
            return f"{type(self).__name__} has no one-kernel layer"
        if not sm_count():
            return "the GPU's SM count is unknown (the CUDA driver library could not be read)"
        return None

    def _layer_kernel(self, lay: dict, win: int):
        """``kernels/layer.cu`` for this layer's shapes: ``(kernel, its input names)``."""
        qkv = lay["qkv"]
        projs = {"qkv": qkv, "o": lay["o"], "gu": lay["gu"], "dn": lay["down"]}

        def make():
            def weights(prefix: str) -> str:
                names = projs[prefix].names()
                return "".join(f"    const auto {n} = {prefix}_{n};\n" for n in names)

            def aliases(pairs: dict[str, str]) -> str:
                return "".join(f"    {'T*' if out else 'const T*'} const {n} = {v};\n"
                               for n, (v, out) in pairs.items())

            def virtual(body: str) -> str:
                return (body.replace("blockIdx.x", "pl_bx").replace("blockIdx.y", "pl_by")
                        .replace("gridDim.x", "pl_gx"))

            qkv_src, qkv_names, pairs = self._qkv_source(qkv, lay["traditional"], lay["pos_scale"], win)
            attn_io = aliases({"q": ("pl_q", False), "o": ("pl_o", True)})
            if self.layer_attn() == "warp":
                attn = fill("layer.cu", "warps", window=win, n_heads=self.n_heads, aliases=attn_io,
                            body=virtual(fill("attn.cu", "warp_body", head_dim=self.head_dim, window=win,
                                              group=self.n_heads // self.n_kv_heads, scale=float_literal(self.scale))))
            else:
                attn = fill("layer.cu", "heads", window=win, chunk=LAYER_ATTN_CHUNK, n_heads=self.n_heads,
                            body=virtual(self._attn_source(win, LAYER_ATTN_CHUNK)), aliases=attn_io)
            phases = {
                "qkv": fill("layer.cu", "blocks", blocks=-(-pairs // WARPS_PER_BLOCK), body=virtual(qkv_src),
                            aliases=aliases({"x": ("hin", False), "q": ("pl_q", True)}) + weights("qkv")),
                "attn": attn,
            }
            for name, prefix, mode, x, extra in (
                    ("o_proj", "o", "residual", "pl_o", {"r": ("hin", False), "out": ("pl_h", True)}),
                    ("gate_up", "gu", "swiglu", "pl_h", {"nw": ("pn", False), "out": ("pl_act", True)}),
                    ("down", "dn", "residual", "pl_act", {"r": ("pl_h", False), "out": ("hout", True)})):
                g = self._gemv_source(projs[prefix], mode)
                phases[name] = fill("layer.cu", "strided", body=virtual(g.source),
                                    aliases=aliases({"x": (x, False), **extra}) + weights(prefix))
            fetch = {"none": [], "ogd": ["o", "gu", "dn"], "all": ["qkv", "o", "gu", "dn"]}[LAYER_PREFETCH]
            asks = [fill("layer.cu", "prefetch", array=f"{prefix}_{n}", bytes=a.nbytes)
                    for prefix in fetch for n, a in zip(projs[prefix].names(), projs[prefix].arrays)]
            if LAYER_PREFETCH_KV:  # after the q/k/v weights (the first phase's), before the later phases'
                first = len(qkv.arrays) if "qkv" in fetch else 0
                asks.insert(first, self._prefetch_kv(win))
            prefetch = "".join(asks)
            trace = self.layer_trace is not None
            marks = {f"mark{i}": fill("layer.cu", "mark", i=i) if trace else "" for i in range(1, 10)}
            src = fill("layer.cu", "body", q_size=self.n_heads * self.head_dim, hidden=self.hidden,
                       sync=LAYER_SYNCS[LAYER_BARRIER], trace_begin=fill("layer.cu", "trace_begin") if trace else "",
                       trace_end=fill("layer.cu", "trace_end") if trace else "", prefetch=prefetch, **marks, **phases)
            names = ["hin", "nw", *[f"qkv_{n}" for n in qkv.names()], *(["bias"] if qkv.bias is not None else []),
                     "inv_freq", "pos", "kc", "vc", "scratch", "counts", "bar", "work",
                     *[f"o_{n}" for n in lay["o"].names()], "pn", *[f"gu_{n}" for n in lay["gu"].names()],
                     *[f"dn_{n}" for n in lay["down"].names()], *(["trace"] if trace else [])]
            return mx.fast.cuda_kernel(name="pl_layer", input_names=names, output_names=["hout"], source=src,
                                       header=header())

        sig = tuple((p.bits, p.group_size, p.in_dim, p.out_dim, p.bias is not None) for p in projs.values())
        return self._kernel(("layer", sig, lay["traditional"], lay["pos_scale"], win, GEMV_UNROLL, SPLIT_MIN_IN,
                             SPLIT_UNITS, GEMV_MMA_MODES, MMA_GROUPS_IN_FLIGHT, LAYER_ATTN_CHUNK, self.layer_attn(),
                             LAYER_BARRIER, LAYER_PREFETCH, LAYER_PREFETCH_KV, ATTN_V_PREFETCH, QKV_UNROLL,
                             self.layer_trace is not None), make)

    def layer_attn(self) -> str:
        """The one-kernel layer's attention phase for this model: ``LAYER_ATTN``, or "block" where the head size
        does not suit attn.cu's warp_body (a multiple of 32 whose 32nd part is a power of two up to 8)."""
        vd = self.head_dim // 32
        fits = self.head_dim % 32 == 0 and vd & (vd - 1) == 0 and vd <= 8
        return LAYER_ATTN if fits else "block"

    def _layer(self, lay: dict, h: mx.array, pos: mx.array, cache) -> mx.array:
        """The layer as one kernel (``kernels/layer.cu``): the residual stream ``(hidden,)`` after it; the token's key
        and value written into ``cache``."""
        kern = self._layer_kernel(lay, cache.max_size or 0)
        qkv = lay["qkv"]
        inputs = [h, lay["in_norm"], *qkv.arrays, *([qkv.bias] if qkv.bias is not None else []), lay["inv_freq"],
                  pos, cache.keys, cache.values, self._scratch, self._counts, self._barrier, self._work,
                  *lay["o"].arrays, lay["post_norm"], *lay["gu"].arrays, *lay["down"].arrays,
                  *([self.layer_trace] if self.layer_trace is not None else [])]
        return self._launch(kern, inputs, sm_count() * LAYER_BLOCKS_PER_SM, self.hidden)

    # -- the step -------------------------------------------------------------------------------------

    def prepare(self, caches, n_positions: int) -> None:
        """Make every cache buffer hold at least ``n_positions`` positions (a ring: ``min(n_positions,
        max_size)`` slots), row-contiguous and materialized (MLX returns the update itself for a slice
        update that covers the whole buffer: a prefill that fills the buffer leaves it a transposed view of
        the new keys), and size the attention scratch (``n_heads * ceil(n_positions / c) * (head_dim + 2)``
        float32, c the smaller of ``attn_chunk`` and ``LAYER_WARP_CHUNK``: enough for either attention)."""
        for c in caches:
            c.reserve(n_positions)
            if c.keys is not None:  # a prefill that filled the whole buffer left it a view of its keys
                c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)
        mx.eval([c.state for c in caches])
        splits = -(-n_positions // min(self.attn_chunk, LAYER_WARP_CHUNK))
        need = self.n_heads * splits * (self.head_dim + 2)
        if self._scratch is None or self._scratch.size < need:
            self._scratch = mx.zeros((need,), mx.float32)
            mx.eval(self._scratch, self._counts)

    def _embed(self, token: mx.array) -> mx.array:
        return self._embed_kernel()(inputs=[token, *self.embed.arrays], template=[("T", self.dtype)],
                                    grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(self.hidden,)],
                                    output_dtypes=[self.dtype])[0]

    def _attend(self, q: mx.array, pos: mx.array, n_ctx: int | None, cache) -> mx.array:
        """Attention output ``(n_heads * head_dim,)`` of the query ``q`` at position ``pos`` over ``cache``: a
        grid of the key chunks up to ``n_ctx`` (a host int = ``pos``), or with ``n_ctx`` None of every chunk
        the cache's buffers hold (the chunks past ``pos`` return at once: the same values)."""
        win = cache.max_size or 0
        if n_ctx is None:
            n_keys = min(cache.keys.shape[2], win) if win else cache.keys.shape[2]
        else:
            n_keys = min(n_ctx + 1, win) if win else n_ctx + 1
        ch = self.attn_chunk
        splits = -(-n_keys // ch)
        return self._attn_kernel(win)(
            inputs=[q, cache.keys, cache.values, pos, self._scratch, self._counts], template=[("T", self.dtype)],
            grid=(splits * ch, self.n_heads, 1), threadgroup=(ch, 1, 1),
            output_shapes=[(self.n_heads * self.head_dim,)], output_dtypes=[self.dtype])[0]

    def step(self, token: mx.array, pos: mx.array, n_ctx: int, caches) -> mx.array:
        h = self._embed(token)
        for lay, c in zip(self.layers, caches):
            if self.one_kernel_layers:
                h = self._layer(lay, h, pos, c)
                continue
            q = self._query(lay, h, pos, c)
            o = self._attend(q, pos, n_ctx, c)
            h = self._gemv(lay["o"], "residual", [o, *lay["o"].arrays, h])
            a = self._gemv(lay["gu"], "swiglu", [h, lay["post_norm"], *lay["gu"].arrays])
            h = self._gemv(lay["down"], "residual", [a, *lay["down"].arrays, h])
        logits = self._gemv(self.head, "norm", [h, self.final_norm, *self.head.arrays])
        return logits[None]

    def _query(self, lay: dict, h: mx.array, pos: mx.array, cache) -> mx.array:
        """The layer's first kernel: the query ``(n_heads * head_dim,)`` of the hidden state ``h`` after RMSNorm,
        the q/k/v projection (and bias) and RoPE; the token's key and value written into ``cache``."""
        qkv = lay["qkv"]
        kern, pairs = self._qkv_kernel(qkv, lay["traditional"], lay["pos_scale"], cache.max_size or 0)
        extra = [qkv.bias] if qkv.bias is not None else []
        inputs = [h, lay["in_norm"], *qkv.arrays, *extra, lay["inv_freq"], pos, cache.keys, cache.values]
        return self._launch(kern, inputs, -(-pairs // WARPS_PER_BLOCK), self.n_heads * self.head_dim)

    def _launch(self, kern, inputs: list, blocks: int, n_out: int, res: bool = False):
        """Run a kernel of 256-thread blocks whose output is ``(n_out,)`` in the compute dtype; with
        ``res`` (a "res" prologue) also returns the new residual stream ``(hidden,)`` it writes."""
        outs = kern(inputs=inputs, template=[("T", self.dtype)], grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[(n_out,), (self.hidden,)] if res else [(n_out,)],
                    output_dtypes=[self.dtype] * (2 if res else 1))
        return (outs[0], outs[1]) if res else outs[0]

    def _gemv(self, proj: Proj, mode: str, inputs: list, proj2: Proj | None = None):
        """Launch a GEMV kernel (``GEMV_MODES``): its output ``(rows,)``, and for prologue "res" also
        the new residual stream ``(hidden,)``."""
        kern, warps, n_out, mma = self._gemv_kernel(proj, mode, proj2)
        blocks = gemv_blocks(-(-warps // WARPS_PER_BLOCK), MMA_BLOCKS_PER_SM if mma else GEMV_BLOCKS_PER_SM)
        return self._launch(kern, inputs, blocks, n_out, self.GEMV_MODES[mode][0] == "res")
