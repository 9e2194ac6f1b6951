"""A model ready to run: its config, device weights and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from etjax.calibration.file import Calibration
from etjax.model.config import ModelConfig
from etjax.model.quantized import weight_formats, weights_bytes
from etjax.model.weights import Weights, parameter_count
from etjax.tokenizer import Tokenizer


@dataclass(frozen=True, eq=False)
class Model:
    """What `etjax.load_model` returns; pass it to `etjax.decode(model=...)`."""

    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    name: str
    source: Path
    # The entropy signal's calibration (etjax/calibration), from `load_model(calibration=)`.
    calibration: Calibration | None = None

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({self.name!r}, layers={c.num_layers}, hidden={c.hidden_size}, "
            f"vocab={c.vocab_size}, dtype={c.dtype}, weights={self.weights_format}, "
            f"params={parameter_count(c) / 1e6:.1f}M, resident={self.weights_bytes / 1e6:.1f} MB)"
        )

    @property
    def weights_format(self) -> str:
        """How the matrices are held: the block formats of its quantized leaves ("q4_1+q8_0",
        "int8"), or the dtype of float ones."""
        formats = sorted(set(weight_formats(self.weights).values()))
        return "+".join(formats) if formats else str(self.weights.embed.dtype)

    @property
    def weights_bytes(self) -> int:
        """Bytes the weights hold resident (a quantized leaf: its blocks)."""
        return weights_bytes(self.weights)
