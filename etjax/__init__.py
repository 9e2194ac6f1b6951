"""etjax: entropic-time LLM decoding in JAX.

Next-token entropy steers the engine: which sequences get compute, which KV-cache blocks
attention reads, and the sampling temperature. Start with `etjax.decode("prompt")`.
"""

from etjax.absent_tpu import skip_absent_tpu

skip_absent_tpu()  # before JAX starts: libtpu on a host without a TPU (etjax/absent_tpu.py)

from etjax.api import Result, decode, load_model  # noqa: E402
from etjax.calibrate.fit import calibrate  # noqa: E402
from etjax.errors import EtjaxError, ModelLoadError, RequestError, TokenizerError  # noqa: E402
from etjax.loaders.loaded_model import Model  # noqa: E402
from etjax.planning.plan import plan  # noqa: E402

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
