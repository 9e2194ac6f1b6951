"""Qwen2: Llama's layer with q/k/v biases (`attention_bias`, always set for Qwen2 by the
config readers); its GGUF files keep the q and k rows in Hugging Face order."""

from __future__ import annotations

from etjax.model.families import llama
from etjax.model.families.family import Family
from etjax.model.leaves import pytree_class

LAYER = llama.layer_table(gguf_interleaved_rope=False)
Qwen2Layer = pytree_class("Qwen2Layer", LAYER, __name__)

QWEN2 = Family(
    name="qwen2",
    layer=LAYER,
    layer_type=Qwen2Layer,
    qkv_projection=llama.qkv_projection,
    output_and_mlp=llama.output_and_mlp,
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
)
