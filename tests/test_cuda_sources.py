"""Every CUDA kernel text the fused decoders build compiles (nvcc, sm_90): default settings and each knob.

Why: kernels that only a knob off by default builds (``decoder.QKV_PREFETCH_KV``, ``LAYER_PREFETCH_KV``) shipped
without ever being compiled: ``pl_prefetch_kv`` took ``const int* kc_shape`` where MLX passes a kernel input's
shape as its own ``Shape`` type, and only an H100 found out. The GPU tests compile what they run, on a GPU; this
test compiles every text, on any machine with ``nvcc`` (skipped without it).

How: each setting's step runs on the CPU with tests/test_fused_gpu.py's ``_RecordingKernel`` standing in for
``mx.fast.cuda_kernel`` (``recorded_step``, its caches holding one position of zeros: the kernels' texts are the
same whatever they hold); each launch's full text is rebuilt as MLX 0.32 builds it (``mlx_kernel_text``, after
mlx/backend/cuda/custom_kernel.cpp's ``build_kernel``: the dtypes and ranks of the launch's very inputs, its template
arguments, its output dtypes) and every distinct text compiled with ``nvcc -arch=sm_90 -cubin -std=c++17`` (through
ptxas, as MLX's NVRTC compiles to an H100's SASS: inline PTX is checked too) against a stand-in of MLX's device header
(``UTILS_STANDIN``). nvcc spends ~1 s of a 2-core machine parsing the CUDA headers of each text, so the texts are
compiled ~10 to a translation unit (``_compile_unit``: each in a namespace of its own, the kernel's text unchanged),
the units in parallel; where a unit fails, the texts nvcc names are compiled alone, as MLX would compile them, for the
report. Measured on the 2-core x86_64 dev machine (nvcc 13.0): 288 distinct texts of 133 settings, 47-52 s in all
(each text alone: 197 s for the compiles only).

Settings (``SETTINGS``; knobs are ``pipeline.engine.cuda.decoder``'s module constants, each set alone over the
defaults; "DIAGONAL": float16 4-bit, bfloat16 8-bit (group 32) and float32 dense, each dtype and weight kind once):

- defaults: llama (BASE) in every dtype (float16, bfloat16, float32) x weights (4-bit group 64, 8-bit group 32,
  dense), the five kernels and one kernel a layer (``one_kernel_layers``): the kernels every family shares; qwen2
  (q/k/v biases, untied head; both paths), qwen3 (QWEN3: one fused q/k/v matrix, and three) and gemma3_text (GEMMA)
  over DIAGONAL: their own kernels (biases, per-head norms, Gemma's GEMV modes) in each dtype and weight kind;
- knobs: ``QKV_PREFETCH_KV``; ``QKV_UNROLL`` 2; ``GEMV_UNROLL`` 2; ``ATTN_V_PREFETCH`` "L1", "L2"; ``GEMV_MMA_MODES``
  every mode, and none (float16 4-bit: the only weights they reach); ``LAYER_PREFETCH_KV``; ``LAYER_PREFETCH``
  "none", "ogd"; ``LAYER_BARRIER`` "gen", "flip"; ``LAYER_ATTN`` "warp" (also at head_dim 128); the layer trace
  (``layer_trace``); the three KV prefetches together over a 64-slot ring. Each on llama over DIAGONAL on every path
  it changes, and once (float16 4-bit) on each other family whose kernels it changes (``KNOBS``). Each knob setting
  must build a text its base does not (else the knob no longer reaches the kernels: the test says so);
- shapes that switch code paths (``SHAPES``): head_dim 96 (attention's fallback value loop), 128, Gemma's 256; 8 query
  heads (128-key attention chunks); an intermediate size of 4,096 (the split down projection, 4- and 8-bit);
  traditional RoPE at group 32; group 128; a 64-slot ring (llama over DIAGONAL, both paths);
- the batched step (``BatchedDecoder``: ``pl_rope_store``, ``pl_batch_attn``, ``pl_load_slots``): llama in each dtype
  over full caches and a 64-slot ring, qwen2, Llama 3 RoPE (its frequencies an input), traditional RoPE;
- the sampling and structured-output kernels (``pl_sample`` in each mode, filters on and off, with and without
  16-byte loads; ``pl_mask`` over float32, float16 and bfloat16 logits).

Left out (time): qwen2, qwen3 and gemma3 outside DIAGONAL (e.g. bfloat16 4-bit: its q/k/v, attention and GEMV code is
llama's, compiled in every combination); the layer-only knobs on qwen2 (its layer differs from llama's by the bias
alone, compiled under the defaults); knob combinations other than the ring's prefetches; values that only change a
number no branch or template depends on (``MMA_GROUPS_IN_FLIGHT``, ``GEMV_BLOCKS_PER_SM``, ``MMA_BLOCKS_PER_SM``,
``LAYER_BLOCKS_PER_SM``, ``SPLIT_UNITS``, ``LAYER_ATTN_CHUNK``, RoPE bases and scales); ``LAYER_ATTN`` "warp" at
head_dim 96 (it falls back to the block attention: the same text, checked in tests/test_fused_gpu.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import mlx.core as mx
import pytest

from pipeline.engine.cache import RotatingKVCache
from pipeline.engine.cuda import BatchedDecoder
from pipeline.engine.cuda import decoder as decoder_module
from pipeline.engine.cuda import mask as mask_module
from pipeline.engine.cuda import sample as sample_module
from pipeline.engine.views import LayerKind
from test_fused_gpu import BASE, GEMMA, QWEN3, _RecordingKernel, make_model, recorded_step

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
NVCC_FLAGS = ["-arch=sm_90", "-cubin", "-std=c++17"]

# A stand-in for MLX's "mlx/backend/cuda/device/utils.cuh" (part of MLX's CUDA build, not of its wheels): what
# the text MLX wraps around a custom kernel needs of it (the half types, cuda::std's array and limits, and the
# Shape / Strides types of ``<input>_shape`` / ``<input>_strides`` parameters, MAX_NDIM 10), nothing more.
UTILS_STANDIN = """\
// Stand-in for MLX's mlx/backend/cuda/device/utils.cuh (tests/test_cuda_sources.py): only what custom kernels use.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}  // namespace mlx::core::cu
"""

# MLX's dtype_to_cuda_type (mlx/backend/cuda/utils.cpp) and get_type_string (the template hash's names).
CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
              mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
              mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}


def _type_string(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def mlx_kernel_text(launch: dict) -> tuple[str, str]:
    """``(kernel name, full CUDA text)`` of a recorded launch (``_RecordingKernel.launches``), as MLX 0.32's
    ``build_kernel`` (mlx/backend/cuda/custom_kernel.cpp) writes it for ``mx.fast.cuda_kernel``: the default
    header, the kernel's header, then in ``namespace mlx::core::cu`` the ``__global__`` function taking each input as
    a const pointer of its dtype (and, for an input of rank > 0, ``<name>_shape`` / ``_strides`` / ``_ndim`` where
    the source mentions them), each output as a pointer, the template arguments as constants and type aliases, and
    the source."""
    src = launch["source"]
    suffix = ""
    for _, v in launch["template"]:
        suffix += ("_t" if v else "_f") if isinstance(v, bool) else f"_{v}" if isinstance(v, int) else \
            f"_{_type_string(v)}"
    name = f"custom_kernel_{launch['name']}{suffix}"
    params = []
    for n, dtype, ndim in zip(launch["input_names"], launch["input_dtypes"], launch["input_ndims"]):
        params.append(f"    const {CUDA_TYPES[dtype]}* {n},\n")
        if ndim > 0:
            for field, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if f"{n}_{field}" in src:
                    params.append(f"    const __grid_constant__ {kind} {n}_{field},\n")
    outs = [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(launch["output_names"], launch["output_dtypes"])]
    consts = ""
    for n, v in launch["template"]:
        if isinstance(v, bool):
            consts += f"  constexpr bool {n} = {str(v).lower()};\n"
        elif isinstance(v, int):
            consts += f"  constexpr int {n} = {v};\n"
        else:
            consts += f"  using {n} = {CUDA_TYPES[v]};\n"
    text = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            "#define inf cuda::std::numeric_limits<float>::infinity()\n\n"
            + launch["header"]
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {name}(\n" + "".join(params) + ",\n".join(outs) + ") {\n"
            + (consts + "\n" if consts else "") + src + "\n}\n\n} // namespace mlx::core::cu\n")
    return name, text


# -- the settings -------------------------------------------------------------------------------------------------

class Setting(NamedTuple):
    kind: str  # "fused" (recorded_step), "batched" (BatchedDecoder), "sampling" (pl_sample, pl_mask)
    config: dict  # make_model's arguments (sampling: sample.py's module constants)
    knobs: dict  # decoder module constants set for the step
    layers: bool = False  # one kernel a layer
    ring: int | None = None  # RotatingKVCache(ring) caches
    trace: bool = False  # the one-kernel layer's trace compiled in
    base: str | None = None  # the setting this one changes only by ``knobs`` / ``trace``


FAMILIES = {"llama": {}, "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False}, "qwen3": QWEN3,
            "qwen3-3mat": {**QWEN3, "fuse_qkv": False}, "gemma3": GEMMA}
LAYER_FAMILIES = ("llama", "qwen2")  # the families with a one-kernel layer
DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
WEIGHTS = {"q4": dict(bits=4, group_size=64), "q8": dict(bits=8, group_size=32), "dense": dict(dense=True)}
CROSS = tuple((d, w) for d in DTYPES for w in WEIGHTS)
# Each dtype and each weight kind once (float16 4-bit first: the only weights of the tensor-core GEMVs).
DIAGONAL = (("f16", "q4"), ("bf16", "q8"), ("f32", "dense"))
F16Q4 = DIAGONAL[:1]
FIVE, LAYER, BOTH = (False,), (True,), (False, True)  # the five-kernel path, the one-kernel layer
EVERY_MMA_MODE = ("swiglu", "residual", "norm", "plain", "geglu", "res_logits")

# The default settings: llama in every dtype and weight kind (the kernels every family shares: embedding, q/k/v,
# attention, the GEMVs, the layer), the other families in DIAGONAL (their own kernels: q/k/v biases, per-head norms,
# Gemma's modes).
DEFAULTS = [("llama", CROSS, BOTH), ("qwen2", DIAGONAL, BOTH), ("qwen3", DIAGONAL, FIVE),
            ("qwen3-3mat", DIAGONAL, FIVE), ("gemma3", DIAGONAL, FIVE)]
# knob id -> (decoder module constants, [(family, its settings, paths)]): llama over DIAGONAL on each path the knob
# changes (the knob's code in each dtype and weight kind), the other families it changes once
LLAMA = ("llama", DIAGONAL, BOTH)
LLAMA_LAYER = [("llama", DIAGONAL, LAYER)]
KNOBS = {
    "qkv-prefetch-kv": ({"QKV_PREFETCH_KV": True}, [("llama", DIAGONAL, FIVE), ("qwen2", F16Q4, FIVE)]),
    "qkv-unroll2": ({"QKV_UNROLL": 2}, [LLAMA, ("qwen2", F16Q4, FIVE)]),
    "gemv-unroll2": ({"GEMV_UNROLL": 2}, [LLAMA, ("qwen3", F16Q4, FIVE), ("qwen3-3mat", F16Q4, FIVE),
                                          ("gemma3", F16Q4, FIVE)]),
    "v-prefetch-l1": ({"ATTN_V_PREFETCH": "L1"}, [LLAMA, ("gemma3", F16Q4, FIVE)]),
    "v-prefetch-l2": ({"ATTN_V_PREFETCH": "L2"}, [LLAMA, ("gemma3", F16Q4, FIVE)]),
    "mma-all": ({"GEMV_MMA_MODES": EVERY_MMA_MODE}, [("llama", F16Q4, BOTH), ("qwen2", F16Q4, BOTH),
                                                      ("qwen3", F16Q4, FIVE), ("gemma3", F16Q4, FIVE)]),
    "mma-none": ({"GEMV_MMA_MODES": ()}, [("llama", F16Q4, BOTH)]),
    "kv-prefetch": ({"LAYER_PREFETCH_KV": True}, LLAMA_LAYER),
    "prefetch-none": ({"LAYER_PREFETCH": "none"}, LLAMA_LAYER),
    "prefetch-ogd": ({"LAYER_PREFETCH": "ogd"}, LLAMA_LAYER),
    "barrier-gen": ({"LAYER_BARRIER": "gen"}, LLAMA_LAYER),
    "barrier-flip": ({"LAYER_BARRIER": "flip"}, LLAMA_LAYER),
    "attn-warp": ({"LAYER_ATTN": "warp"}, LLAMA_LAYER),
}
# Shapes that switch code paths, float16 4-bit unless given: id -> (family, make_model overrides, paths)
SHAPES = {
    "hd96": ("llama", dict(head_dim=96, num_attention_heads=2, num_key_value_heads=1), BOTH),  # value fallback loop
    "hd128": ("llama", dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1), BOTH),
    "gemma3-hd256": ("gemma3", dict(head_dim=256, num_attention_heads=2, query_pre_attn_scalar=256), FIVE),
    "heads8": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32), FIVE),  # 128-key chunks
    "split-q4": ("llama", dict(intermediate_size=4096), BOTH),  # the down projection split over the block
    "split-q8": ("qwen2", dict(intermediate_size=4096, dtype=mx.bfloat16, **WEIGHTS["q8"]), BOTH),
    "trad-g32": ("llama", dict(rope_traditional=True, group_size=32), BOTH),
    "g128": ("qwen2", dict(group_size=128), FIVE),
}
PREFETCHES = {"QKV_PREFETCH_KV": True, "LAYER_PREFETCH_KV": True, "ATTN_V_PREFETCH": "L2"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}


def _settings() -> dict[str, Setting]:
    out: dict[str, Setting] = {}

    def config(fam: str, d: str, w: str) -> dict:
        return {**FAMILIES[fam], **WEIGHTS[w], "dtype": DTYPES[d]}

    def sid(fam: str, d: str, w: str, layers: bool) -> str:
        return f"{fam}-{d}-{w}" + ("-layer" if layers else "")

    for fam, combos, paths in DEFAULTS:
        for d, w in combos:
            for layers in paths:
                out[sid(fam, d, w, layers)] = Setting("fused", config(fam, d, w), {}, layers=layers)
    for kid, (knobs, targets) in KNOBS.items():
        for fam, combos, paths in targets:
            for d, w in combos:
                for layers in paths:
                    base = sid(fam, d, w, layers)
                    out[f"{base}-{kid}"] = Setting("fused", config(fam, d, w), knobs, layers=layers, base=base)
    for name, (fam, over, paths) in SHAPES.items():
        for layers in paths:
            out[name + ("-layer" if layers else "")] = Setting("fused", {**config(fam, "f16", "q4"), **over}, {},
                                                                layers=layers)
    out["hd128-layer-attn-warp"] = Setting("fused", out["hd128-layer"].config, KNOBS["attn-warp"][0], layers=True,
                                           base="hd128-layer")
    for d, w in DIAGONAL:
        base = sid("llama", d, w, True)
        out[f"{base}-trace"] = Setting("fused", config("llama", d, w), {}, layers=True, trace=True, base=base)
        for layers in BOTH:
            base = sid("llama", d, w, layers)
            out[f"{base}-ring64"] = Setting("fused", config("llama", d, w), {}, layers=layers, ring=64)
            out[f"{base}-ring64-prefetches"] = Setting("fused", config("llama", d, w), PREFETCHES, layers=layers,
                                                       ring=64, base=f"{base}-ring64")
    for d, dtype in DTYPES.items():
        for ring in (None, 64):
            out[f"batched-llama-{d}" + ("-ring64" if ring else "")] = Setting("batched", {"dtype": dtype}, {},
                                                                               ring=ring)
    out["batched-qwen2-f16"] = Setting("batched", {**FAMILIES["qwen2"], "dtype": mx.float16}, {})
    out["batched-llama-f16-llama3-rope"] = Setting("batched", {"dtype": mx.float16, "rope_scaling": LLAMA3_ROPE}, {})
    out["batched-llama-bf16-trad-rope"] = Setting("batched", {"dtype": mx.bfloat16, "rope_traditional": True}, {})
    for vec in (True, False):
        out["sampling" + ("" if vec else "-novec")] = Setting("sampling", {"VEC": vec}, {})
    return out


SETTINGS = _settings()


def _describe(sid: str) -> str:
    s = SETTINGS[sid]
    extra = [f"{k}={v!r}" for k, v in s.knobs.items()] + (["trace"] if s.trace else [])
    return sid + (f" [{', '.join(extra)}]" if extra else "")


# -- recording ----------------------------------------------------------------------------------------------------

_MODELS: dict = {}


def _model(config: dict):
    """``make_model(**config)``, built once per configuration (random weights take most of a recording)."""
    key = repr(sorted(config.items()))
    if key not in _MODELS:
        _MODELS[key] = make_model(**config)
    return _MODELS[key]


def _record_fused(mp: pytest.MonkeyPatch, s: Setting) -> list[dict]:
    mp.setattr(decoder_module, "sm_count", lambda: 132)  # the one-kernel layer's grid (no CUDA driver here)
    for k, v in s.knobs.items():
        mp.setattr(decoder_module, k, v)
    layers = s.config.get("num_hidden_layers", BASE["num_hidden_layers"])
    caches = (lambda: [RotatingKVCache(s.ring) for _ in range(layers)]) if s.ring else None

    def trace(dec):
        if s.trace:
            dec.layer_trace = mx.zeros((132 * decoder_module.LAYER_BLOCKS_PER_SM * 16,), mx.uint64)

    return recorded_step(mp, one_kernel_layers=s.layers, prefill=False, make_caches=caches, configure=trace,
                         model=_model(s.config))[3]


def _record_batched(mp: pytest.MonkeyPatch, s: Setting) -> list[dict]:
    """``BatchedDecoder``'s step over 2 rows (caches of 256 slots, or a ring), then its ``load_slots``."""
    mp.setattr(mx.fast, "cuda_kernel", _RecordingKernel)
    _RecordingKernel.launches = []
    model = _model(s.config)
    dtype = s.config["dtype"]
    n = len(model.model.layers)
    dec = BatchedDecoder(model, [LayerKind(False, s.ring or 256, s.ring, None, None)] * n)
    a = model.model.layers[0].self_attn
    bufs = [mx.zeros((2, a.n_kv_heads, s.ring or 256, a.head_dim), dtype) for _ in range(2 * n)]
    mx.eval(dec.step(mx.array([1, 2], mx.uint32), mx.array([5, 70], mx.int32), None, bufs))
    prefill = [mx.zeros((1, a.n_kv_heads, 8, a.head_dim), dtype) for _ in (0, 1)]
    row = mx.array([0], mx.int32)
    dec.load_slots(0, *prefill, row, row, mx.array([8], mx.int32), bufs[0], bufs[1])
    return _RecordingKernel.launches


def _record_sampling(mp: pytest.MonkeyPatch, s: Setting) -> list[dict]:
    """``pl_sample`` in each mode, filters on and off (a vocabulary of 1,024: a multiple of 4, as VEC needs), and
    ``pl_mask`` over float32, float16 and bfloat16 logits."""
    mp.setattr(mx.fast, "cuda_kernel", _RecordingKernel)
    for k, v in s.config.items():
        mp.setattr(sample_module, k, v)
    mp.setattr(sample_module, "_kernels", {})
    _RecordingKernel.launches = []
    x = mx.zeros((2, 1024), mx.float32)
    inputs = sample_module._inputs(x, 50, 0.9, 0.05, mx.zeros((2,), mx.float32))
    sample_module.launch(0, inputs, filters=False)
    sample_module.launch(0, inputs)
    sample_module.launch(2, inputs + [sample_module.launch(1, inputs)])
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        mp.setattr(mask_module, "_kernels", {})
        mask_module._call(x.astype(dtype), mx.zeros((2, 32), mx.uint32))
    return _RecordingKernel.launches


RECORDERS: dict[str, Callable] = {"fused": _record_fused, "batched": _record_batched, "sampling": _record_sampling}


def record(sid: str) -> list[tuple[str, str]]:
    """The distinct ``(kernel name, full text)`` of setting ``sid``'s launches, in launch order."""
    with pytest.MonkeyPatch.context() as mp:
        launches = RECORDERS[SETTINGS[sid].kind](mp, SETTINGS[sid])
    assert launches, sid
    return list(dict.fromkeys(mlx_kernel_text(k) for k in launches))


# -- compiling ----------------------------------------------------------------------------------------------------

# build_kernel's namespace around the kernel: what follows it differs from text to text, what precedes it (the
# includes and the kernel's header) is shared by every text of a module (common.cuh's, sample.cu's, none)
_OPEN, _CLOSE = "namespace mlx::core::cu {\n", "} // namespace mlx::core::cu\n"
TEXTS_PER_UNIT = 10


class Compiled(NamedTuple):
    path: str  # the .cu file nvcc compiled (the text alone)
    returncode: int
    errors: str  # nvcc's first error lines ("" where it compiled)


def _first_errors(output: str, n: int = 14) -> str:
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if re.search(r"\berror\b", line)), 0)
    return "\n".join(lines[first:first + n])


def _nvcc(text: str, root: str) -> tuple[str, subprocess.CompletedProcess]:
    path = os.path.join(root, hashlib.sha256(text.encode()).hexdigest()[:20] + ".cu")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path, subprocess.run([NVCC, *NVCC_FLAGS, f"-I{root}", path, "-o", path[:-3] + ".cubin"],
                                capture_output=True, text=True)


def _compile_unit(texts: list[str], root: str) -> dict[str, Compiled]:
    """Compile ``texts`` (one shared prefix) as ONE translation unit: the prefix once, then each text's namespace
    with a namespace of its own inside (``mlx::core::cu::pl_text_<i>``: the kernel sees the names it sees in MLX's
    text), so nvcc parses the CUDA headers once for the unit, not once a text. Where the unit fails, the texts whose
    lines nvcc's messages name are compiled alone, exactly as MLX would compile them (for the report), the others
    again as a unit (a front-end error stops nvcc before the later phases of every kernel); where no text's lines
    are named, every text alone."""
    prefix = texts[0][:texts[0].index(_OPEN)]
    unit, starts = prefix, []
    for i, text in enumerate(texts):
        own = text[len(prefix):]
        assert text.startswith(prefix) and own.startswith(_OPEN) and own.endswith(_CLOSE)
        starts.append(unit.count("\n") + 1)
        unit += f"{_OPEN}namespace pl_text_{i} {{\n{own[len(_OPEN):-len(_CLOSE)]}}}  // pl_text_{i}\n{_CLOSE}"
    path, r = _nvcc(unit, root)
    if r.returncode == 0:
        return {text: Compiled(path, 0, "") for text in texts}
    named = {int(n) for n in re.findall(r"\((\d+)\): |at line (\d+)", r.stderr + r.stdout) for n in n if n}
    ends = starts[1:] + [unit.count("\n") + 2]
    blamed = [t for t, a, b in zip(texts, starts, ends) if any(a <= n < b for n in named)] or texts
    out = {}
    for text in blamed:
        path, r = _nvcc(text, root)
        out[text] = Compiled(path, r.returncode, _first_errors(r.stderr + r.stdout) if r.returncode else "")
    rest = [t for t in texts if t not in out]
    return {**out, **(_compile_unit(rest, root) if rest else {})}


def compile_all(texts: list[str], root: str) -> dict[str, Compiled]:
    """Every text compiled, in units of about ``TEXTS_PER_UNIT`` texts of one prefix (the largest spread over the
    units), the units in parallel on every core."""
    by_prefix: dict[str, list[str]] = {}
    for text in texts:
        by_prefix.setdefault(text[:text.index(_OPEN)], []).append(text)
    units = []
    for group in by_prefix.values():
        n = -(-len(group) // TEXTS_PER_UNIT)
        group = sorted(group, key=len, reverse=True)
        units += [group[i::n] for i in range(n)]
    units.sort(key=lambda u: -sum(map(len, u)))  # the longest first
    results: dict[str, Compiled] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for done in pool.map(lambda u: _compile_unit(u, root), units):
            results.update(done)
    return results


def _selected(session) -> list[str]:
    """The settings of this session's selected ``test_kernel_texts_compile`` items."""
    return [item.callspec.params["sid"] for item in session.items
            if getattr(item, "originalname", None) == "test_kernel_texts_compile"]


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """Every selected setting's texts, and every distinct text's compilation: ``(texts of each setting, result of
    each text)``."""
    root = tmp_path_factory.mktemp("cuda-sources")
    (root / "mlx/backend/cuda/device").mkdir(parents=True)
    (root / "mlx/backend/cuda/device/utils.cuh").write_text(UTILS_STANDIN, encoding="utf-8")
    sids = _selected(request.session) or list(SETTINGS)
    texts = {sid: record(sid) for sid in sids}
    distinct = list(dict.fromkeys(text for t in texts.values() for _, text in t))
    results = compile_all(distinct, str(root))
    print(f"\n{len(distinct)} distinct kernel texts of {len(sids)} settings compiled: nvcc {' '.join(NVCC_FLAGS)}")
    return texts, results


@pytest.mark.parametrize("sid", list(SETTINGS))
def test_kernel_texts_compile(sid, compiled):
    """Every kernel text of the setting compiles; a knob setting builds at least one text its base does not (the
    knob reaches the kernels)."""
    texts, results = compiled
    failed = [(name, text) for name, text in texts[sid] if results[text].returncode]
    if failed:
        report = []
        for name, text in failed:
            c = results[text]
            others = [o for o, t in texts.items() if o != sid and any(x == text for _, x in t)]
            also = (f" (the same text in {len(others)} other settings: {', '.join(others[:4])}"
                    f"{' ...' if len(others) > 4 else ''})") if others else ""
            report.append(f"{name} of {_describe(sid)}{also}: nvcc exit {c.returncode} on {c.path}\n{c.errors}")
        pytest.fail(f"{len(failed)} of {len(texts[sid])} kernel texts do not compile:\n\n" + "\n\n".join(report),
                    pytrace=False)
    base = SETTINGS[sid].base
    if base is not None:
        base_texts = texts[base] if base in texts else record(base)
        assert set(texts[sid]) - set(base_texts), f"{_describe(sid)} builds the same kernels as {base}"
