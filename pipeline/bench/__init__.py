"""``pipeline bench``: speed of the engine against mlx-lm on the same weights, batch-1 decode or job throughput."""

from .decode import run_bench
from .settings import BenchError, BenchFailed, parse_cache_kind
from .shapes import PUBLIC_SHAPES, RANDOM_SHAPES, load_weights, random_tensor, random_weights
from .tables import SCHEMA, format_table
from .throughput import distinct_prompts, run_batch_bench

__all__ = ["PUBLIC_SHAPES", "RANDOM_SHAPES", "SCHEMA", "BenchError", "BenchFailed", "distinct_prompts",
           "format_table", "load_weights", "parse_cache_kind", "random_tensor", "random_weights", "run_batch_bench",
           "run_bench"]
