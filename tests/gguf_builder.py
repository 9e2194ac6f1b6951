"""Write small GGUF files from tiny Hugging Face models, the way llama.cpp's converter does.

Used to test etjax's GGUF reader against transformers' on quantization types the embedded
model does not use. The tokenizer metadata is copied from the real SmolLM2 GGUF.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for adjacent-pair RoPE (the inverse of what etjax undoes)."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    hf_model, path: Path, tokenizer_source: Path, matrix_type: gguf.GGMLQuantizationType
) -> None:
    """Write `hf_model` (a transformers LlamaForCausalLM) to `path`.

    Norms stay F32 as in llama.cpp; every matrix is stored as `matrix_type`.
    """
    cfg = hf_model.config
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    _copy_tokenizer_metadata(writer, tokenizer_source)

    def matrix(name: str, w: np.ndarray) -> None:
        w = np.ascontiguousarray(w, dtype=np.float32)
        if matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif matrix_type == gguf.GGMLQuantizationType.Q8_1:
            # No quantizer exists for Q8_1; zero blocks of the right size stand in for the bytes.
            block, size = gguf.GGML_QUANT_SIZES[matrix_type]
            raw = np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, quantize(w, matrix_type), raw_dtype=matrix_type)

    matrix("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        q = llama_cpp_permute(state[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = llama_cpp_permute(state[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        matrix(b + "attn_q.weight", q)
        matrix(b + "attn_k.weight", k)
        matrix(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        matrix(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        matrix(b + "ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        matrix(b + "ffn_up.weight", state[p + "mlp.up_proj.weight"])
        matrix(b + "ffn_down.weight", state[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        matrix("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
)


@functools.cache
def _tokenizer_metadata(source: Path) -> dict:
    reader = gguf.GGUFReader(source)
    return {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}


def _copy_tokenizer_metadata(writer: gguf.GGUFWriter, source: Path) -> None:
    value = _tokenizer_metadata(source).__getitem__
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(value("tokenizer.chat_template"))


def write_f32_gguf(hf_model, path: Path, arch: str) -> None:
    """Write `hf_model` (a transformers Qwen3, Phi-3 or Gemma 2 causal LM) to `path` as
    llama.cpp's converter lays out its `arch` ("qwen3", "phi3" or "gemma2"), every tensor
    F32, without a tokenizer.

    No architecture's q and k rows are permuted (llama.cpp rotates them in the Hugging Face
    half-split layout); Phi-3's fused projections keep their Hugging Face names' order:
    `attn_qkv` is q|k|v, `ffn_up` gate|up; Gemma 2's norms are stored as 1 + w, the scale
    they apply.
    """
    cfg = hf_model.config
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = _writer_with_shapes(path, arch, cfg)
    if getattr(cfg, "sliding_window", None) and arch in ("phi3", "gemma2"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    _add_rope_scaling(writer, arch, cfg)

    names = {  # Hugging Face name under model.layers.{i}. -> llama.cpp name under blk.{i}.
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    separate = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
    }
    if arch == "qwen3":
        names |= separate | {
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
        }
    elif arch == "gemma2":
        names |= separate | {
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        }
        state = {k: v + 1 if k.endswith("norm.weight") else v for k, v in state.items()}
    else:
        names |= {
            "self_attn.qkv_proj.weight": "attn_qkv.weight",
            "mlp.gate_up_proj.weight": "ffn_up.weight",
        }
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, cpp in names.items():
            writer.add_tensor(f"blk.{i}.{cpp}", state[f"model.layers.{i}.{hf}"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_rope_scaling(writer: gguf.GGUFWriter, arch: str, cfg) -> None:
    # What llama.cpp's converter writes of `cfg`'s RoPE scaling: linear and yarn as keys
    # (yarn's optional fields where the config has them); Phi-3 its original context always,
    # and for longrope the temperature as a key and the factors as tensors.
    rope = cfg.rope_parameters
    kind = rope.get("rope_type", "default")
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings")
        original = original or cfg.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )
            long, short = (np.asarray(rope[k], np.float32) for k in ("long_factor", "short_factor"))
            writer.add_tensor("rope_factors_long.weight", long)
            writer.add_tensor("rope_factors_short.weight", short)
    elif kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        optional = {
            "attention_factor": writer.add_rope_scaling_yarn_attn_factor,
            "beta_fast": writer.add_rope_scaling_yarn_beta_fast,
            "beta_slow": writer.add_rope_scaling_yarn_beta_slow,
        }
        for key, add in optional.items():
            if rope.get(key) is not None:
                add(rope[key])


def _writer_with_shapes(path: Path, arch: str, cfg) -> gguf.GGUFWriter:
    # A writer holding the metadata every architecture has, from transformers config `cfg`.
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def write_moe_gguf(
    hf_model,
    path: Path,
    arch: str,
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    split_experts: bool = False,
    fuse_gate_up: bool = False,
) -> None:
    """Write `hf_model` (a transformers Qwen3-MoE or Mixtral causal LM) to `path` as
    llama.cpp's converter lays out `arch` ("qwen3moe", or "llama" for Mixtral), without a
    tokenizer; norms F32, every matrix `matrix_type`.

    Each layer's router is `ffn_gate_inp` and its experts' gate, up and down matrices (as
    transformers' `[out, in]`) are stacked into `ffn_{gate,up,down}_exps`, `[E, out, in]`;
    `split_experts`: one tensor per expert instead, `ffn_gate.{e}`, as llama.cpp wrote Mixtral
    before April 2024; `fuse_gate_up`: gate|up as one `ffn_gate_up_exps`, `[E, 2M, D]`, as
    the converter's `--fuse-gate-up-exps` writes them. Mixtral's q and k rows are
    interleaved per head as Llama's, its experts' width is `feed_forward_length`; Qwen3-MoE
    keeps Hugging Face's q/k order and writes its width as `expert_feed_forward_length`.
    Neither writes `norm_topk_prob`.
    """
    cfg = hf_model.config
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = _writer_with_shapes(path, arch, cfg)
    writer.add_expert_count(cfg.num_local_experts if arch == "llama" else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def matrix(name: str, w: np.ndarray) -> None:
        w = np.ascontiguousarray(w, dtype=np.float32)
        if matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize(w, matrix_type), raw_dtype=matrix_type)

    matrix("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q = llama_cpp_permute(q, cfg.num_attention_heads)
            k = llama_cpp_permute(k, cfg.num_key_value_heads)
        else:
            writer.add_tensor(b + "attn_q_norm.weight", state[p + "self_attn.q_norm.weight"])
            writer.add_tensor(b + "attn_k_norm.weight", state[p + "self_attn.k_norm.weight"])
        matrix(b + "attn_q.weight", q)
        matrix(b + "attn_k.weight", k)
        matrix(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        matrix(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        matrix(b + "ffn_gate_inp.weight", state[p + "mlp.gate.weight"])
        # transformers keeps each layer's experts as gate|up [E, 2M, D] and down [E, D, M].
        gate, up = np.split(state[p + "mlp.experts.gate_up_proj"], 2, axis=1)
        experts = {"gate": gate, "up": up, "down": state[p + "mlp.experts.down_proj"]}
        if fuse_gate_up:
            experts = {"gate_up": state[p + "mlp.experts.gate_up_proj"], "down": experts["down"]}
        for proj, stacked in experts.items():
            if split_experts:
                for e, w in enumerate(stacked):
                    matrix(f"{b}ffn_{proj}.{e}.weight", w)
            else:
                matrix(f"{b}ffn_{proj}_exps.weight", stacked)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        matrix("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
