"""`etjax serve`: the command, and the process's life around the application.

    etjax serve [--model M] [--config C] [--host 127.0.0.1] [--port 8000] [--api-key K]

It binds the socket first (so `--port 0` can print the port it got), starts uvicorn, and
loads the model behind it (/health is 503 until the engine is warm). SIGTERM or SIGINT drain:
the listening socket closes, new requests on open connections get 503, requests in flight
run to their end within `--grace-period` seconds (then they are cut), and the process exits
0. A model that fails to load ends it with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys

log = logging.getLogger("etjax")

API_KEY_ENV = "ETJAX_API_KEY"


def add_serve(commands) -> None:
    """Register `etjax serve` on the CLI's subcommands."""
    from etjax.serve.limits import ServeLimits
    from etjax.serve.warm_up import WARM_UPS

    d = ServeLimits()
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--model",
        default=None,
        help="a model name, path or hub id (default: the config's, else the embedded one)",
    )
    serve.add_argument(
        "--config",
        default="default",
        help="a run config (a name in configs/ or a .toml path): engine sizes and the "
        "[request] and [sampler] defaults of requests",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: local)")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"required as 'Authorization: Bearer KEY' on every route but /health "
        f"(default: env {API_KEY_ENV}, else none)",
    )
    serve.add_argument("--max-tokens", type=int, default=d.max_tokens, help="per sample, at most")
    serve.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="samples queued beyond the engine's resident rows before 429",
    )
    serve.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds")
    serve.add_argument(
        "--grace-period",
        type=float,
        default=d.grace_period,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    serve.add_argument(
        "--warm-up",
        choices=WARM_UPS,
        default="buckets",
        help="before ready, compile a step program for every token and row bucket "
        "(buckets), or run one short request (one: a quicker start; a first batch may wait "
        "for the compiler)",
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT (exit 0), or until the model fails to load (exit 2)."""
    from etjax.errors import ConfigError, FieldError

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("etjax serve needs its extra: pip install 'etjax[serve]'") from None
    from etjax.run_config import load_run_config
    from etjax.serve.app import make_app
    from etjax.serve.limits import ServeLimits
    from etjax.serve.state import FAILED, ServerState

    # Everything a flag can get wrong fails before the socket and the model.
    try:
        limits = ServeLimits(
            max_body_bytes=args.max_body_bytes,
            max_tokens=args.max_tokens,
            max_waiting=args.max_waiting,
            request_timeout=args.request_timeout,
            grace_period=args.grace_period,
        )
    except FieldError as e:
        flag = "--" + e.field.replace("_", "-")
        raise ConfigError(f"{flag}={e.value!r}; must be {e.allowed}") from None
    config = load_run_config(args.config)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (loading the model)", where, port)
    if api_key is None and not _loopback(host):
        log.warning("%s is reachable from other machines and no API key is set", where)
    state = ServerState(config, limits, model_arg=args.model, api_key=api_key, warm_up=args.warm_up)
    server = _Server(state, limits.grace_period)
    app = make_app(state, on_failure=server.stop)
    server.configure(app)
    server.run(sockets=[sock])
    return 2 if state.phase == FAILED else 0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    from etjax.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server:
    """uvicorn's server, whose exit on SIGTERM or SIGINT first turns the state to draining
    (new requests 503) and then exits 0, rather than re-raising the signal as uvicorn does."""

    def __init__(self, state, grace_period: float) -> None:
        self.state, self.grace_period = state, grace_period
        self.server = None

    def configure(self, app) -> None:
        import uvicorn

        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=self.grace_period,
            lifespan="on",
        )
        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                handlers = {s: signal.signal(s, self.handle_exit) for s in _SIGNALS}
                try:
                    yield
                finally:
                    for s, handler in handlers.items():
                        signal.signal(s, handler)

            def handle_exit(self, sig, frame) -> None:
                outer.drain()
                super().handle_exit(sig, frame)

        self.server = Server(config)

    def run(self, sockets: list[socket.socket]) -> None:
        self.server.run(sockets=sockets)

    def drain(self) -> None:
        from etjax.serve.state import DRAINING, READY

        if self.state.phase == READY:
            self.state.phase = DRAINING
            in_flight = self.state.bridge.in_flight if self.state.bridge else 0
            print(
                f"etjax: draining: {in_flight} samples in flight get {self.grace_period:g} s",
                file=sys.stderr,
            )

    def stop(self) -> None:
        """End the server from any thread (the model failed to load)."""
        if self.server is not None:
            self.server.should_exit = True


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
