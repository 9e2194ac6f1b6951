"""The architecture registry: every decoder family etjax runs, by `ModelConfig.architecture`.

A family (family.py) is a table of its layer's weight leaves, the functions its layer computes
around the shared attention, and the names model files give it. Loaders, checkpoints, the
mesh placement and the forward pass find everything architecture-specific here, so adding an
architecture is a module in this package and a line below (plus any config fields its layer
reads).
"""

from __future__ import annotations

from etjax.model.families.family import Family
from etjax.model.families.gemma2 import GEMMA2
from etjax.model.families.gemma3 import GEMMA3
from etjax.model.families.llama import LLAMA
from etjax.model.families.mixtral import MIXTRAL
from etjax.model.families.phi3 import PHI3
from etjax.model.families.qwen2 import QWEN2
from etjax.model.families.qwen3 import QWEN3
from etjax.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLAMA, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, QWEN3_MOE, MIXTRAL)
}


def family(architecture: str) -> Family:
    """The family named `architecture`; ValueError naming the allowed ones if none."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"architecture={architecture!r} is not supported; allowed: {tuple(FAMILIES)}"
        ) from None


def hf_model_types() -> dict[str, Family]:
    """Each Hugging Face `model_type` etjax reads, and its family."""
    return {t: f for f in FAMILIES.values() for t in f.hf_model_types}


def gguf_architectures() -> tuple[str, ...]:
    """Each GGUF `general.architecture` etjax reads."""
    return tuple(dict.fromkeys(a for f in FAMILIES.values() for a in f.gguf_architectures))


def gguf_family(architecture: str, routed_experts: bool) -> Family | None:
    """The family of a GGUF file of `architecture` with routed experts (`{arch}.expert_count`
    > 0) or without; None where etjax reads no such file."""
    for f in FAMILIES.values():
        if architecture in f.gguf_architectures and f.routed_experts == routed_experts:
            return f
    return None
