"""`ServerState`: what the routes share: the phase (loading, ready, draining, failed), the
model, the engine bridge, the metrics and the limits; and `load`, which brings it to ready.

The server listens before the model loads, so `/health` can say 503 while it loads and warms
up; `load` runs on a thread of its own: the model, an engine over a page pool of fixed size
(the run config's `[engine] num_pages`, else `DEFAULT_POOL_PAGES`: the pool's size is a shape
of every step program, so it is fixed for the server's life), a warm-up that compiles the
step programs requests will run (etjax/serve/warm_up.py), then the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from etjax.engine_build import build_engine, request_pages
from etjax.loaders.embedded import EMBEDDED_MODEL_NAME
from etjax.loaders.loaded_model import Model
from etjax.run_config import RunConfig
from etjax.serve.body import ServeRequest
from etjax.serve.bridge import EngineBridge
from etjax.serve.errors import ApiError
from etjax.serve.limits import ServeLimits
from etjax.serve.metrics import Metrics
from etjax.serve.warm_up import warm_up

log = logging.getLogger("etjax")

DEFAULT_POOL_PAGES = 1024  # 16K tokens at 16 a page; SmolLM2-135M's float32 KV: 0.75 GB
LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


@dataclasses.dataclass
class ServerState:
    """Shared by the routes; `phase` moves loading -> ready -> draining (or -> failed)."""

    config: RunConfig
    limits: ServeLimits
    model_arg: str | None = None  # --model, or None for the config's (or the embedded) model
    api_key: str | None = None
    warm_up: str = "buckets"  # etjax/serve/warm_up.py: which programs compile before ready
    phase: str = LOADING
    failure: str = ""
    model: Model | None = None
    bridge: EngineBridge | None = None
    metrics: Metrics = dataclasses.field(default_factory=Metrics)

    @property
    def model_name(self) -> str:
        """The name answers carry and /v1/models lists."""
        return self.model_arg or self.config.model.name or EMBEDDED_MODEL_NAME

    @property
    def served(self) -> frozenset[str]:
        """The names a request's `model` may give: the served name and the model's own."""
        own = {self.model.name} if self.model is not None else set()
        return frozenset({self.model_name, *own})

    def require_ready(self) -> None:
        """ApiError 503 unless requests can be served now."""
        if self.phase == READY:
            return
        what = {
            LOADING: "the model is loading and warming up; retry when /health says ready",
            DRAINING: "the server is shutting down",
            FAILED: f"the model failed to load: {self.failure}",
        }[self.phase]
        raise ApiError(503, what, code=f"server_{self.phase}", headers={"Retry-After": "5"})

    def check_fits(self, request: ServeRequest) -> None:
        """ApiError 400 for a request the page pool could never hold."""
        options = self.bridge.engine.options
        need = request_pages(len(request.prompt_ids), request.samples[0], options)
        pool = self.bridge.engine.page_cache.num_pages - 1
        if need > pool:
            raise ApiError(
                400,
                f"{len(request.prompt_ids)} prompt tokens + max_tokens="
                f"{request.samples[0].max_new_tokens} need {need} KV pages; this server's pool "
                f"has {pool}",
                "max_tokens",
                "context_length_exceeded",
            )

    def load(self, on_failure: Callable[[], None]) -> None:
        """Load the model, build and warm the engine, start its thread; on an error, log it,
        set the phase to failed and call `on_failure` (the server then exits)."""
        from etjax.loaders.resolve import load_model

        try:
            started = time.perf_counter()
            config = self.config
            self.model = load_model(
                self.model_arg or config.model.name,
                dtype=config.model.dtype,
                calibration=config.model.calibration,
                weights=config.model.weights,
            )
            log.info("%r loaded in %.1fs", self.model, time.perf_counter() - started)
            options = dataclasses.replace(config.options, calibration=self.model.calibration)
            engine = build_engine(
                self.model.weights,
                self.model.config,
                self.model.tokenizer,
                options,
                num_pages=options.num_pages or DEFAULT_POOL_PAGES,
            )
            started = time.perf_counter()
            warm_up(engine, self.model.tokenizer, self.warm_up)
            log.info("warmed up (%s) in %.1fs", self.warm_up, time.perf_counter() - started)
            self.bridge = EngineBridge(
                engine, self.metrics, self.limits.max_waiting, self.limits.request_timeout
            )
            self.bridge.start()
            if self.phase == LOADING:
                self.phase = READY
                log.info("ready: serving %s", self.model_name)
        except Exception as e:  # any failure to load is reported, then the server exits
            log.error("the model failed to load: %s", e)
            self.phase, self.failure = FAILED, str(e)
            on_failure()
