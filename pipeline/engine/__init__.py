"""The decode engine: one loaded model's sequential (``Engine``) and batched (``BatchEngine``) generation."""

from .batch import BatchEngine, Request
from .sequential import Engine, GenerateParams, Generation

__all__ = ["BatchEngine", "Engine", "GenerateParams", "Generation", "Request"]
