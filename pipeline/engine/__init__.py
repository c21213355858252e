"""The decode engine: one loaded model's sequential (``Engine``) and batched (``BatchEngine``) generation.

Where things go: a request's checks, stops and result in ``request``; which step decodes in ``step``
(fused, compiled, eager, batched); the sequential loop in ``sequential``, the batched one in ``batch``;
KV caches in ``cache`` and the steps' views of them in ``views``; sampling in ``sampler``; stop strings
and completion text in ``stops``; the compiled closures in ``compiled``; the fused CUDA step in ``cuda``.
"""

from .batch import BatchEngine
from .params import GenerateParams, Generation
from .request import Request
from .sequential import Engine

__all__ = ["BatchEngine", "Engine", "GenerateParams", "Generation", "Request"]
