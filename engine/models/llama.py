"""The Llama family as our own torch modules: Llama 2/3.x (rope scaling), SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens are flattened across sequences ([T, hidden], varlen style). The decoder layer's math exists here once,
split where the KV cache steps in: `pre_attention` (input norm with the residual add, q/k/v projections,
q/k norm, rotary) -> attention, supplied by the caller (paged attention in gpu mode, a ring buffer in the
offload modes, a CUDA graph's static buffers) -> `post_attention` (o_proj, post norm with the residual add,
MLP). `qkv_rows` / `post_rows` run the same two halves in chunks of rows, in place, to bound activation
memory on long prompts. q/k/v and gate/up projections are fused into one matmul each; the loader fuses the
checkpoint's tensors.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.registry import ModelArgs
from engine.ops.attention import default_scale
from engine.ops.fused import qk_norm_rope, rope, silu_mul
from engine.step import StepContext
from engine.trace.events import COMPUTE

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, q, k, v) -> o
StoreKV = Callable[[torch.Tensor, torch.Tensor, int, int], None]                 # (k, v, first row, end row)


class Attention(nn.Module):
    """The attention block's weights (the attention itself is the caller's: it knows where KV lives)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nq, self.nkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = default_scale(self.d)
        self.qkv_proj = Linear(a.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=a.attention_bias)
        self.o_proj = Linear(self.nq * self.d, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None

    def project(self, x: torch.Tensor, cos_sin):
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] with norms and rotary applied."""
        q, k, v = self.qkv_proj(x).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k, v = q.view(-1, self.nq, self.d), k.view(-1, self.nkv, self.d), v.view(-1, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *cos_sin)
        else:
            q, k = rope(q, k, *cos_sin)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)), out)     # into out if given


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def pre_attention(self, h: torch.Tensor, residual: torch.Tensor | None, cos_sin):
        """(h, residual) -> (q, k, v, residual): the input norm fused with the residual add (None: the first
        layer, whose residual is h itself), then q/k/v with their norms and rotary."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        q, k, v = self.self_attn.project(x, cos_sin)
        return q, k, v, residual

    def query(self, residual: torch.Tensor, cos_sin) -> torch.Tensor:
        """The query [T, Hq, D] this layer makes from the residual stream `residual` (its input's sum, before the
        norm). Given the layer before's input instead, a guess of this layer's query one layer early: the
        residual stream changes little from layer to layer (InfiniGen, Lee et al., 2024)."""
        return self.self_attn.project(self.input_layernorm(residual), cos_sin)[0]

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor):
        """Attention output o [T, Hq, D] -> (h, residual): o_proj, the post norm fused with the residual add, MLP."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(o.flatten(1)), residual)
        return self.mlp(x), residual

    def qkv_rows(self, h: torch.Tensor, residual: torch.Tensor, cos_sin, store: StoreKV, chunk: int = 0):
        """`pre_attention`'s work over rows in chunks of `chunk` (0: all at once), the residual add in place in
        `residual`; each chunk's k, v go to store(k, v, first, end). -> q [T, Hq, D]."""
        T, step = h.shape[0], chunk or h.shape[0]
        q = None
        for a in range(0, T, step):
            b = min(T, a + step)
            qa, k, v = self.self_attn.project(self.input_layernorm.add_(h[a:b], residual[a:b]),
                                              (cos_sin[0][a:b], cos_sin[1][a:b]))
            store(k, v, a, b)
            if step >= T:
                return qa
            if q is None:
                q = torch.empty((T, *qa.shape[1:]), dtype=qa.dtype, device=qa.device)
            q[a:b] = qa
        return q

    def post_rows(self, o: torch.Tensor, h: torch.Tensor, residual: torch.Tensor, chunk: int = 0) -> None:
        """`post_attention`'s work over rows in chunks of `chunk` (0: all at once), in place in h and residual (the
        sum added where it is, the MLP's down projection writing h: no copies into the caller's buffers)."""
        T, step = h.shape[0], chunk or h.shape[0]
        for a in range(0, T, step):
            b = min(T, a + step)
            x = self.post_attention_layernorm.add_(self.self_attn.o_proj(o[a:b].flatten(1)), residual[a:b])
            self.mlp(x, out=h[a:b])


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        # (weights given: no random init, which on the meta device imports torch._dynamo, ~3 s of a CPU's start)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.layer_names = [f"layer {i}" for i in range(a.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, ctx: StepContext
                ) -> torch.Tensor:
        """All layers over the whole batch, attention by `attend(layer, q, k, v)` -> final hidden states
        [T, hidden] (normed). Call `logits` on the rows you need."""
        rec = ctx.recorder
        h, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        if rec.detail and h.is_cuda:
            return self._forward_marked(h, residual, cos_sin, attend, ctx)
        for i, layer in enumerate(self.layers):
            with rec.span(COMPUTE, self.layer_names[i], i):
                with rec.span(COMPUTE, "attention", i):
                    q, k, v, residual = layer.pre_attention(h, residual, cos_sin)
                    o = attend(i, q, k, v)
                with rec.span(COMPUTE, "mlp", i):
                    h, residual = layer.post_attention(o, residual)
            ctx.layer_done(i + 1, len(self.layers))
        return self.norm(h, residual)[0]

    def _forward_marked(self, h, residual, cos_sin, attend: Attend, ctx: StepContext) -> torch.Tensor:
        """`forward` with its timeline on CUDA: a layer's three spans share their boundary marks, two timing events a
        layer where the spans took six (the next step reads them: ~180 events for the default model's prefill had
        made that step 0.4-0.6 ms longer on an H100)."""
        rec = ctx.recorder
        start = rec.mark()
        for i, layer in enumerate(self.layers):
            q, k, v, residual = layer.pre_attention(h, residual, cos_sin)
            o = attend(i, q, k, v)
            mid = rec.mark()
            h, residual = layer.post_attention(o, residual)
            end = rec.mark()
            rec.add_event_span(COMPUTE, self.layer_names[i], start, end, i)
            rec.add_event_span(COMPUTE, "attention", start, mid, i)
            rec.add_event_span(COMPUTE, "mlp", mid, end, i)
            ctx.layer_done(i + 1, len(self.layers))
            start = end
        return self.norm(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
