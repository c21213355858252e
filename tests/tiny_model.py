"""A tiny random-weight llama model directory with the default model's real tokenizer and chat template,
for end-to-end runs of ``pipeline run`` that take seconds, not minutes."""

from __future__ import annotations

from pathlib import Path

# isort: off
import pipeline  # noqa: F401  (first: loads OpenBLAS before mlx.core, as `pipeline run` and Ray actors do)
import mlx.core as mx
from mlx.utils import tree_flatten
# isort: on

from pipeline.convert import write_model_dir
from pipeline.models.llama import Model, ModelArgs
from pipeline.tokenizer import Tokenizer

TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def _default_tokenizer() -> Tokenizer:
    """The default model's tokenizer, built from its GGUF metadata (the file is fetched on first use)."""
    from pipeline.resolve import DEFAULT_MODEL, resolve_model

    _, md = mx.load(str(resolve_model(DEFAULT_MODEL)), return_metadata=True)
    return Tokenizer.from_gguf_metadata(md)


def write_tiny_model(path: str | Path, *, seed: int = 0, tokenizer: Tokenizer | None = None) -> Path:
    """Write a random-weight llama (hidden 64, 2 layers, 4 heads, 2 KV heads, context 512) as a model
    directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
    (BOS/EOS tokens and the chat template), ``generation_config.json``.

    The weights are a pure function of ``seed``, so two calls write byte-identical files (and the
    same model fingerprint). The projection weights are scaled up 4x as in ``tests/test_engine.py``:
    at MLX's default init the layers barely move the residual stream and greedy decoding with tied
    embeddings repeats one token forever.

    Args:
        path: the directory to create (parents too); existing files in it are overwritten.
        seed: the MLX random seed for the weights.
        tokenizer: the tokenizer to save (default: the default model's, whose vocabulary size the
            model then takes).

    Returns:
        ``path`` as a ``Path``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or _default_tokenizer()
    eos_ids = list(tok.eos_token_ids)
    config = {**TINY_CONFIG, "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id, "eos_token_id": eos_ids}

    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    weights = {k: v * 4 if k.endswith("proj.weight") else v for k, v in tree_flatten(model.parameters())}
    write_model_dir(path, config, weights, tok)
    return path


def write_prompts(path: Path, rows: int) -> Path:
    """A Parquet input of ``rows`` prompts of varied length, ids ``row-00``, ``row-01``, ..."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = [f"Item {i}: " + " ".join(["tell me more"] * (1 + i % 5)) for i in range(rows)]
    pq.write_table(pa.table({"id": [f"row-{i:02d}" for i in range(rows)], "prompt": text}), path)
    return path


def wait_until(cond, proc, timeout: float = 120.0, what: str = "the awaited moment") -> None:
    """Poll ``cond()`` every 5 ms until it is true, failing if the subprocess ``proc`` (a ``Popen``) ends
    first or ``timeout`` seconds pass; ``what`` names the awaited moment in the failure messages."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}:\n{proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def without_machine_warnings(stderr: str) -> list[str]:
    """The lines of a ``pipeline`` command's ``stderr`` less the one warning that depends on the machine and
    not on the command: MLX cannot compile on this CPU (no ``g++``: ``compiled.cpu_compile_blocker``), which
    every model load logs there. Where MLX can compile, nothing is dropped."""
    from pipeline.engine.compiled import cpu_compile_blocker

    reason = cpu_compile_blocker()
    drop = None if reason is None else f"WARNING: {reason}: decode runs eagerly"
    return [line for line in stderr.strip().splitlines() if drop is None or not line.startswith(drop)]
