"""pipeline: batch offline text generation on MLX."""

__version__ = "0.2.0"

from ._blas import load_openblas

load_openblas()  # before anything imports mlx.core

import atexit  # noqa: E402

import mlx.core as mx  # noqa: E402

from .loader import LoadedModel, load_model  # noqa: E402

# MLX's CPU streams own a worker thread each; left to static destructors at process exit, the thread was
# now and then destroyed unjoined ("terminate called without an active exception", SIGABRT after a correct
# run). MLX asks callers to destroy a thread's streams themselves (mlx#4327; its own test runner calls
# mx.clear_streams() last). Registered first, so it runs after every later atexit handler.
atexit.register(mx.clear_streams)

__all__ = ["LoadedModel", "load_model", "__version__"]
