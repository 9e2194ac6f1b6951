"""etjax: entropic-time LLM decoding in JAX.

Next-token entropy steers the engine: which sequences get compute, which KV-cache blocks
attention reads, and the sampling temperature. Start with `etjax.decode("prompt")`.
"""

from etjax.api import Result, decode, load_model
from etjax.calibrate.fit import calibrate
from etjax.errors import EtjaxError, ModelLoadError, RequestError, TokenizerError
from etjax.loaders.loaded_model import Model
from etjax.planning.plan import plan

__all__ = [
    "EtjaxError",
    "Model",
    "ModelLoadError",
    "RequestError",
    "Result",
    "TokenizerError",
    "calibrate",
    "decode",
    "load_model",
    "plan",
]
__version__ = "0.1.0"
