"""pipeline: batch offline text generation on MLX."""

__version__ = "0.2.0"

from ._blas import load_openblas
from ._kernel_cache import set_driver_cache, set_ptx_cache

load_openblas()  # before anything imports mlx.core
set_driver_cache()  # before MLX starts the CUDA driver

import atexit  # noqa: E402

import mlx.core as mx  # noqa: E402

set_ptx_cache(mx)  # before MLX's first kernel compile

from .loader import LoadedModel, load_model  # noqa: E402

# MLX's CPU streams own a worker thread each; left to static destructors at process exit, the thread was
# now and then destroyed unjoined ("terminate called without an active exception", SIGABRT after a correct
# run). MLX asks callers to destroy a thread's streams themselves (mlx#4327; its own test runner calls
# mx.clear_streams() last). Registered first, so it runs after every later atexit handler.
atexit.register(mx.clear_streams)

__all__ = ["LoadedModel", "load_model", "__version__"]
