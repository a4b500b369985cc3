"""Tiny random models of each architecture, saved as real Hugging Face folders by transformers."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_model(arch: str, folder, seed: int = 0):
    """Save a tiny random `arch` ("llama", "qwen2", "qwen3") to `folder`; return transformers' model (fp32, eval)."""
    import transformers as tf
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**COMMON)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, head_dim=32)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # larger weights than the init so logits differ clearly between positions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.eval().save_pretrained(str(folder))
    return model
