"""The Llama family as our own torch modules: Llama 2/3.x (rope scaling), SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens are flattened across sequences ([T, hidden], varlen style); AttnMetadata says where each belongs.
q/k/v and gate/up projections are fused into one matmul each; the loader fuses the checkpoint's tensors.
Layers are reachable one by one (embed, layers[i], final norm, logits) so the offload modes can drive them.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops.fused import qk_norm_rope, rope, silu_mul
from engine.trace.events import COMPUTE
from engine.trace.recorder import NULL_RECORDER
from engine.models.registry import ModelArgs
from engine.ops.attention import AttnMetadata, default_scale


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nq, self.nkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.nq * self.d, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.attn = PagedAttention(self.nq, self.nkv, self.d, default_scale(self.d))

    def project(self, x: torch.Tensor, cos_sin):
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] with norms and rotary applied."""
        q, k, v = self.qkv_proj(x).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k, v = q.view(-1, self.nq, self.d), k.view(-1, self.nkv, self.d), v.view(-1, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *cos_sin)
        else:
            q, k = rope(q, k, *cos_sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos_sin, meta: AttnMetadata) -> torch.Tensor:
        q, k, v = self.project(x, cos_sin)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def attention(self, h, residual, cos_sin, meta):
        """(h, residual) -> (attention output, residual); the residual add is fused into the norm."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.self_attn(h, cos_sin, meta), residual

    def feed_forward(self, h, residual):
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward(self, h, residual, cos_sin, meta):
        return self.feed_forward(*self.attention(h, residual, cos_sin, meta))


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.recorder = NULL_RECORDER  # set by the model runner; spans per layer (attention, MLP)
        self.task = None               # an engine.control.TaskState while a request runs: cancel and progress
        self.layer_names = [f"layer {i}" for i in range(a.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """-> final hidden states [T, hidden] (normed). Call `logits` on the rows you need."""
        rec = self.recorder
        h, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            with rec.span(COMPUTE, self.layer_names[i], i):
                with rec.span(COMPUTE, "attention", i):
                    h, residual = layer.attention(h, residual, cos_sin, meta)
                with rec.span(COMPUTE, "mlp", i):
                    h, residual = layer.feed_forward(h, residual)
            if self.task is not None:
                self.task.layer_done(i + 1, len(self.layers))
        return self.norm(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
