"""Host side of the fused CUDA decode step of the Gemma 3 layer (``Gemma3Decoder``)."""

from __future__ import annotations

import mlx.core as mx

from .decoder import MAX_SMEM_BYTES, FusedDecoder, Proj, projs_problem, rope_table


class Gemma3Decoder(FusedDecoder):
    """The fused decode step of a Gemma 3 text model (``pipeline.models.gemma3_text``, after mlx-lm's
    gemma3_text.py). Per layer five kernels:

    1. the previous layer's residual step (``h + rms_norm(down_out, post_feedforward_layernorm)``; the
       first layer starts from the scaled embedding), RMSNorm, the q/k/v projections, the per-head
       q/k RMSNorms, RoPE (local base on sliding layers), and the key/value written into the cache
       (each head's rows over several blocks, the last of them to finish doing the head's norms);
    2. attention (a sliding layer's ``RotatingKVCache`` ring holds exactly the query's window);
    3. o_proj;
    4. ``h + rms_norm(o_out, post_attention_layernorm)``, ``pre_feedforward_layernorm``, the gate and up
       projections and ``gelu_approx(gate) * up``;
    5. down_proj;

    and the final kernel does the last residual step, the final norm and the (tied) output projection.
    Gemma's norm weights are offsets from 1 (``1 + w`` is precomputed in the compute dtype, as the model
    computes it); in float16 the residual sums are taken in float32 and clipped to the float16 range;
    the embedding is scaled by ``sqrt(hidden_size)`` rounded to bfloat16 — all as mlx-lm's model does.
    """

    model_types = ("gemma3_text",)

    def __init__(self, model):
        super().__init__(model)
        self.final_norm = 1.0 + model.model.norm.weight
        self.embed_scale = mx.array(self.hidden**0.5, mx.bfloat16).astype(self.dtype).item()
        mx.eval(self.final_norm)

    @staticmethod
    def _shape_problem(model, dtype: mx.Dtype, head_dim: int) -> str | None:
        # The q/k/v kernel stages x and the residual (hidden values each) and two head rows of floats.
        if 2 * model.args.hidden_size * dtype.size + 2 * 4 * head_dim > MAX_SMEM_BYTES - 1024:
            return f"hidden size {model.args.hidden_size} too large for one block's shared memory"
        return None

    @staticmethod
    def _layer_projs(layer) -> tuple[str | None, list[Proj]]:
        """``(why the layer cannot run here or None, its projections)``: q/k/v of one quantization,
        gate/up of one quantization, no biases."""
        a, m = layer.self_attn, layer.mlp
        groups = [[Proj(a.q_proj), Proj(a.k_proj), Proj(a.v_proj)], [Proj(m.gate_proj), Proj(m.up_proj)],
                  [Proj(a.o_proj)], [Proj(m.down_proj)]]
        why = projs_problem(groups, "q/k/v or gate/up")
        return (why, []) if why else (None, [p for group in groups for p in group])

    def _read_layer(self, layer) -> dict:
        a, m = layer.self_attn, layer.mlp
        inv, pscale, trad = rope_table(a.rope, self.head_dim)
        one = lambda norm: 1.0 + norm.weight  # noqa: E731 - Gemma's RMSNorm scales by 1 + weight
        return {"in_norm": one(layer.input_layernorm), "post_attn": one(layer.post_attention_layernorm),
                "pre_ff": one(layer.pre_feedforward_layernorm), "post_ff": one(layer.post_feedforward_layernorm),
                "q_norm": one(a.q_norm), "k_norm": one(a.k_norm),
                "q": Proj(a.q_proj), "k": Proj(a.k_proj), "v": Proj(a.v_proj), "o": Proj(a.o_proj),
                "gate": Proj(m.gate_proj), "up": Proj(m.up_proj), "down": Proj(m.down_proj),
                "inv_freq": inv, "pos_scale": pscale, "traditional": trad}

    def step(self, token: mx.array, pos: mx.array, n_ctx: int, caches) -> mx.array:
        h = self._embed(token)
        pending = None  # the previous layer's down_proj output and post-feedforward norm, not yet added to h
        for lay, c in zip(self.layers, caches):
            if pending is None:
                q = self._qkv_norm(lay, [h, lay["in_norm"]], pos, c)
            else:
                q, h = self._qkv_norm(lay, [pending[0], h, pending[1], lay["in_norm"]], pos, c, res=True)
            o = self._attend(q, pos, n_ctx, c)
            y = self._gemv(lay["o"], "plain", [o, *lay["o"].arrays])
            a, h = self._gemv(lay["gate"], "geglu", [y, h, lay["post_attn"], lay["pre_ff"], *lay["gate"].arrays,
                                                     *lay["up"].arrays], proj2=lay["up"])
            y = self._gemv(lay["down"], "plain", [a, *lay["down"].arrays])
            pending = (y, lay["post_ff"])
        logits = self._gemv(self.head, "res_logits", [pending[0], h, pending[1], self.final_norm, *self.head.arrays])
        return logits[None]
