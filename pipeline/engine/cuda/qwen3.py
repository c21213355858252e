"""Host side of the fused CUDA decode step of the Qwen 3 layer (``Qwen3Decoder``)."""

from __future__ import annotations

import mlx.core as mx

from .decoder import MAX_SMEM_BYTES, FusedDecoder, Proj, projs_problem


class Qwen3Decoder(FusedDecoder):
    """The fused decode step of a dense Qwen 3 model (``pipeline.models.qwen3``, after mlx-lm's qwen3.py):
    Qwen2's layer without q/k/v biases, with an RMSNorm over ``head_dim`` on each query and key head
    before RoPE (plain weights, ``mx.fast.rms_norm``'s rounding). Per layer the five kernels of
    ``FusedDecoder`` (see ``pipeline.engine.cuda``), the first of them ``kernels/qkv_norm.cu`` (Gemma 3's
    q/k/v step with the "norm" prologue): RMSNorm, the q/k/v projection (fused or three matrices of one
    quantization), the per-head q/k norms, RoPE and the cache write; each head's rows spread over blocks,
    the last of them to finish doing the head's norm.
    """

    model_types = ("qwen3",)

    @staticmethod
    def _shape_problem(model, dtype: mx.Dtype, head_dim: int) -> str | None:
        # The q/k/v kernel stages x (hidden values) and two head rows of floats in shared memory.
        if model.args.hidden_size * dtype.size + 2 * 4 * head_dim > MAX_SMEM_BYTES - 1024:
            return f"hidden size {model.args.hidden_size} too large for one block's shared memory"
        return None

    @staticmethod
    def _qkv_projs(attn) -> list[Proj]:
        if "qkv_proj" in attn:
            return [Proj(attn.qkv_proj)]
        return [Proj(attn.q_proj), Proj(attn.k_proj), Proj(attn.v_proj)]

    @classmethod
    def _layer_projs(cls, layer) -> tuple[str | None, list[Proj]]:
        """``(why the layer cannot run here or None, its projections)``: q/k/v fused or of one quantization,
        the gate/up projection fused (``pipeline.models.base.fuse_projections``), no biases."""
        a, m = layer.self_attn, layer.mlp
        if "gate_up_proj" not in m:
            return "gate/up projections are not fused (their weights differ in kind)", []
        groups = [cls._qkv_projs(a), [Proj(a.o_proj)], [Proj(m.gate_up_proj)], [Proj(m.down_proj)]]
        why = projs_problem(groups, "q/k/v")
        return (why, []) if why else (None, [p for group in groups for p in group])

    @classmethod
    def _qkv_entries(cls, attn) -> dict:
        """``{"qkv": Proj}`` of a fused q/k/v matrix, else ``{"q": .., "k": .., "v": ..}`` (``_qkv_norm_kernel``)."""
        qkv = cls._qkv_projs(attn)
        return {"qkv": qkv[0]} if len(qkv) == 1 else dict(zip("qkv", qkv))

    def _read_layer(self, layer) -> dict:
        a = layer.self_attn
        return {**super()._read_layer(layer), "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}

    def _query(self, lay: dict, h: mx.array, pos: mx.array, cache) -> mx.array:
        return self._qkv_norm(lay, [h, lay["in_norm"]], pos, cache)
