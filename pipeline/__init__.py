"""pipeline: batch offline text generation on MLX."""

__version__ = "0.2.0"

from ._blas import load_openblas

load_openblas()  # before anything imports mlx.core

from .loader import LoadedModel, load_model  # noqa: E402

__all__ = ["LoadedModel", "load_model", "__version__"]
