"""The result document (schema ``pipeline.bench/1``) both drivers return, and its plain-text tables.

The document's fields are described in ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import inspect
import json
import os
import platform
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .. import _blas
from ..engine import Engine
from ..models import dequantized_nbytes
from .shapes import BenchModel, weight_format, weight_read_bytes
from .settings import BenchFailed

SCHEMA = "pipeline.bench/1"


def machine_info() -> dict:
    """Platform, CPU, Python, mlx and mlx-lm versions, default device, BLAS state and UTC date."""
    info = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "mlx": mx.__version__, "device": str(mx.default_device()),
        "blas": _blas.STATE.to_dict(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        info["mlx_lm"] = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        info["mlx_lm"] = None
    try:
        dev = mx.device_info()
        info["device_info"] = {k: v for k, v in dev.items() if isinstance(v, (str, int, float))}
    except Exception:  # noqa: BLE001 - not every backend describes itself
        pass
    return info


def engine_features() -> dict:
    """Which of ``compile`` (compiled vs eager decode), ``fused`` (the fused CUDA step) and
    ``cache_spec`` (rotating / quantized KV caches) ``Engine`` takes, as recorded in the document."""
    params = inspect.signature(Engine.__init__).parameters
    return {name: name in params for name in ("compile", "fused", "cache_spec")}


def result_document(bm: BenchModel, *, context: int, prompt_tokens: list[int], max_tokens: int, trials: int,
                    kinds: list[dict], variants, prefill_step_size: int, seed: int, peer_info: dict, rows: list[dict],
                    skipped: list[dict], notes: list[str], batch: dict | None = None, temperature: float = 0.0,
                    top_p: float = 1.0, ignore_eos: bool = True) -> dict:
    """The result document of one run: schema, machine, settings, model, rows, skipped rows and notes.

    ``batch``: batch mode's extra settings (``batch_sizes``, ``prompts``, ``prompts_b1``,
    ``warmup_tokens``, ``prompts_file``); with it ``settings.mode`` is "batch". ``temperature`` and
    ``top_p``: the sampling settings every row ran (``greedy``: temperature 0).
    """
    settings = {
        **({"mode": "batch"} if batch is not None else {}),
        "model": bm.source, "prompt_tokens": list(prompt_tokens), "max_tokens": max_tokens, "trials": trials,
        "caches": [k["name"] for k in kinds], "variants": list(variants), "dtype": str(bm.dtype),
        "dequantize": bm.dequantize, "dequantized": bm.dequantized,
        "prefill_step_size": prefill_step_size, "seed": seed, "greedy": temperature == 0,
        "temperature": temperature, "top_p": top_p, "ignore_eos": ignore_eos,
        "engine_features": engine_features(), "peer": peer_info, **(batch or {}),
    }
    return {
        "schema": SCHEMA,
        "machine": machine_info(),
        "settings": settings,
        "model": {
            "model_type": bm.config["model_type"], "config": bm.config, "context_length": context,
            "parameters": dequantized_nbytes(bm.model, mx.float32) // 4,
            "weight_read_bytes": weight_read_bytes(bm.model), "dequantized": bm.dequantized,
            "weights": weight_format(bm.model), "load_s": bm.load_s,
        },
        "rows": rows,
        "skipped": skipped,
        "notes": notes,
    }


def emit(doc: dict, echo: Callable[[str], None], json_path: str | Path | None) -> dict:
    """Print ``doc``'s table with ``echo``, write it as JSON to ``json_path`` (if given), return it."""
    echo(format_table(doc))
    if json_path is not None:
        try:
            Path(json_path).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
        except OSError as e:  # checked before the run (settings.check_json_path); a full disk now, say
            raise BenchFailed(f"--json {json_path}: cannot write it: {e.strerror or e} (the table above has the "
                              "results)") from None
    return doc


# --- tables ---------------------------------------------------------------------------------------------


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row_line(row: dict) -> str:
    m = row["median"]
    return (f"{row['impl']} {row['variant']} cache={row['cache']} prompt={row['prompt_tokens']}: "
            f"warm-up {row['warmup_s']:.2f}s, TTFT {m['ttft_s'] * 1e3:.1f} ms, prefill {m['prefill_tps']:.1f} tok/s, "
            f"decode {_fmt(m['decode_tps'], '.1f')} tok/s (median of {len(row['trials'])})")


def same_format_peer(row: dict, peer: dict | None, notes: list[str], where: str = "") -> dict | None:
    """``peer`` (mlx-lm's row matching ``row``) when both ran the same weight format, else None, with a note
    (once in ``notes``) saying why no ratio is given; ``where`` prefixes the note (e.g. "B=64: ")."""
    if peer is not None and peer["weights"] != row["weights"]:
        note = (f"{where}no x_peer: ours ran {row['weights']} weights, mlx-lm {peer['weights']} "
                "(a ratio across weight formats compares kernels, not engines)")
        if note not in notes:
            notes.append(note)
        return None
    return peer


def sampling_label(temperature: float, top_p: float) -> str:
    """``greedy``, or ``temperature 0.8, top_p 0.95`` (top_p left out when 1: off)."""
    if temperature == 0:
        return "greedy"
    return f"temperature {temperature:g}" + (f", top_p {top_p:g}" if top_p < 1 else "")


def _sampling_cell(row: dict) -> str:
    """The table's ``sampling`` cell: ``greedy`` or ``t=0.8,p=0.95``."""
    if row["temperature"] == 0:
        return "greedy"
    return f"t={row['temperature']:g}" + (f",p={row['top_p']:g}" if row["top_p"] < 1 else "")


def _weights_cell(fmt: str) -> str:
    """A ``weight_format`` without spaces, for a table cell: ``4bit-g64``, ``float16``, ``float16+4bit-g64``."""
    return fmt.replace("-bit g", "bit-g").replace(" + ", "+").replace(" ", "-")


def _batch_row_line(row: dict) -> str:
    m = row["median"]
    compile_setting = f" compile={row['compile']}" if row["compile"] is not None else ""
    return (f"{row['impl']} {row['variant']}{compile_setting} cache={row['cache']} B={row['batch_size']} "
            f"{sampling_label(row['temperature'], row['top_p'])}, weights {row['weights']}: "
            f"warm-up {row['warmup_s']:.2f}s, {row['prompts']} prompts in {m['wall_s']:.2f}s, "
            f"{m['job_tps']:.1f} tok/s (median of {len(row['trials'])})")


def _model_line(doc: dict) -> str:
    s, mod = doc["settings"], doc["model"]
    src = s["model"].get("spec") or f"random {s['model']['random']} (4-bit, group 64)"
    weights = f"weights: ours {mod.get('weights', '?')}"
    if s["peer"].get("ran"):
        weights += f", mlx-lm {s['peer'].get('weights', '?')}"
    return (f"model: {src}, {mod['model_type']}, {mod['parameters'] / 1e6:.1f}M parameters; "
            f"dtype {s['dtype']}, ours dequantized: {str(mod['dequantized']).lower()}; {weights}")


def _device_line(mach: dict) -> str:
    """``device: Device(cpu, 0) (x86_64, 2 cores), CPU BLAS: OpenBLAS (...), mlx 0.32.4, mlx-lm 0.32.2, DATE``."""
    blas = mach.get("blas")
    cpu_blas = ""
    if isinstance(blas, dict) and "cpu" in mach["device"]:
        cpu_blas = f", CPU BLAS: {blas['line']}"
    return (f"device: {mach['device']} ({mach['processor']}, {mach['cpu_count']} cores){cpu_blas}, mlx {mach['mlx']}, "
            f"mlx-lm {mach.get('mlx_lm')}, {mach['date']}")


def _grid(cols: list[str], lines: list[list[str]], left: int) -> list[str]:
    """The header and row lines, columns two spaces apart: the first ``left`` left-aligned, the rest right."""
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]

    def fmt_line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt_line(cols)] + [fmt_line(line) for line in lines]


def _skipped_and_notes(doc: dict, keys: tuple[str, ...]) -> list[str]:
    out = []
    for sk in doc["skipped"]:
        what = " ".join(f"{k}={sk[k]}" for k in keys if k in sk)
        out.append(f"skipped: {what}: {sk['reason']}")
    return out + [f"note: {n}" for n in doc["notes"]]


def _format_batch_table(doc: dict) -> str:
    s = doc["settings"]
    b1 = f" ({s['prompts_b1']} at B=1)" if s["prompts_b1"] != s["prompts"] else ""
    sampling = sampling_label(s["temperature"], s["top_p"])
    pf = s.get("prompts_file")
    if pf:
        what = (f"{s['prompts']} prompts{b1} of {pf['path']} (column {pf['prompt_column']!r}, chat template "
                f"{'applied' if pf['chat_template'] else 'not applied'}; {pf['prompt_tokens']['min']}-"
                f"{pf['prompt_tokens']['max']} tokens, mean {pf['prompt_tokens']['mean']:.1f}), up to "
                f"{s['max_tokens']} new tokens each, {sampling}, EOS stops")
    else:
        what = (f"{s['prompts']} prompts{b1} of {s['prompt_tokens'][0]} random tokens, {s['max_tokens']} new "
                f"tokens each, {sampling}, ignore_eos")
    head = [
        _model_line(doc),
        _device_line(doc["machine"]),
        f"job throughput: {what}; generated tokens / wall s (prefill included); median of {s['trials']} "
        f"trials after 1 warm-up (warmup_s, excluded)",
    ]
    cols = ["impl", "variant", "compile", "cache", "weights", "sampling", "B", "prompts", "warmup_s", "wall_s",
            "job_tok/s", "x_peer", "x_sequential"]
    lines = []
    for r in doc["rows"]:
        m = r["median"]
        compile_setting = "-" if r["compile"] is None else r["compile"] + ("(compiled)" if r["compiled"] else "(eager)")
        lines.append([r["impl"], r["variant"], compile_setting, r["cache"], _weights_cell(r["weights"]),
                      _sampling_cell(r), str(r["batch_size"]), str(r["prompts"]), f"{r['warmup_s']:.2f}",
                      f"{m['wall_s']:.2f}", f"{m['job_tps']:.1f}", _fmt(r.get("ratio_vs_peer"), ".2f"),
                      _fmt(r.get("speedup_vs_sequential"), ".2f")])
    out = head + [""] + _grid(cols, lines, left=6)
    out.append("x_peer: ours / mlx-lm batch_generate at the same B, same weight format only; x_sequential: ours / "
               "our sequential Engine.generate loop (same compile setting)")
    out += _skipped_and_notes(doc, ("impl", "variant", "cache", "batch_size"))
    return "\n".join(out)


def format_table(doc: dict) -> str:
    """The plain-text table: one line per row, medians of the trials; ``x peer`` columns are
    ours / mlx-lm for tok/s (above 1: ours faster) and ours / mlx-lm for TTFT (below 1: ours faster).
    Batch mode: one line per (implementation, variant, batch size), job tok/s."""
    if doc["settings"].get("mode") == "batch":
        return _format_batch_table(doc)
    s, mod = doc["settings"], doc["model"]
    head = [
        f"{_model_line(doc)}; weights read per token: ours {mod['weight_read_bytes'] / 1e6:.1f} MB"
        + (f", mlx-lm {s['peer']['weight_read_bytes'] / 1e6:.1f} MB" if s["peer"].get("ran") else ""),
        _device_line(doc["machine"]),
        f"{s['max_tokens']} new tokens, greedy, ignore_eos; median of {s['trials']} trials after 1 warm-up "
        f"(warmup_s: its wall time, excluded)",
    ]
    cols = ["impl", "variant", "cache", "prompt", "warmup_s", "ttft_ms", "prefill_tok/s", "decode_tok/s", "GB/s",
            "decode_x_peer", "prefill_x_peer", "ttft_x_peer"]
    lines = []
    for r in doc["rows"]:
        m, vp = r["median"], r.get("vs_peer") or {}
        variant = r["variant"]
        if r["impl"] == "pipeline" and r.get("compiled") is False and variant == "compiled":
            variant += "(fell back: eager)"
        mark = "*" if vp.get("same_cache_layout") is False else ""
        lines.append([r["impl"], variant, r["cache"], str(r["prompt_tokens"]), f"{r['warmup_s']:.2f}",
                      f"{m['ttft_s'] * 1e3:.1f}", f"{m['prefill_tps']:.1f}", _fmt(m["decode_tps"], ".1f"),
                      _fmt(r["bandwidth_gbps"], ".2f"), _fmt(vp.get("decode_tps"), ".2f") + mark,
                      _fmt(vp.get("prefill_tps"), ".2f") + mark, _fmt(vp.get("ttft_s"), ".2f") + mark])
    out = head + [""] + _grid(cols, lines, left=3)
    if any(r.get("cache_layout_matches_ours") is False for r in doc["rows"]):
        out.append("*: mlx-lm ran another cache layout for this kind (see the notes); not like for like")
    out += _skipped_and_notes(doc, ("impl", "variant", "cache", "prompt_tokens"))
    return "\n".join(out)
