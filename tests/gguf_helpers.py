"""A transformers Llama written as a GGUF file (float32 tensors, llama.cpp's names and its
rotary permutation of the query and key rows), with the tokenizer of SmolLM2's GGUF: what
``kvqrs eval --model FILE.gguf`` reads, made from a tiny random model in a test."""

from __future__ import annotations

import pathlib

LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w, heads: int):
    """llama.cpp's order of the rotary halves (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: pathlib.Path, tokenizer_gguf: pathlib.Path) -> pathlib.Path:
    """Write ``model`` (a ``LlamaForCausalLM`` with tied embeddings and head_dim = hidden /
    heads) to ``path`` with the ``tokenizer.*`` fields of ``tokenizer_gguf``."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    cfg = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for key, field in GGUFReader(str(tokenizer_gguf)).fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == GGUFValueType.ARRAY
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if array else None)
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif name.startswith("model.layers."):
            layer, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}.get(part)
            w.add_tensor(f"blk.{layer}.{LAYER_TENSORS[part]}.weight", a if heads is None else _permute(a, heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
