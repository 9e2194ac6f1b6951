"""`etjax serve`: an OpenAI-compatible HTTP server over one engine (docs/SERVING.md).

A file per idea: `command.py` (the CLI and the process's life: listen, load, drain on
SIGTERM), `app.py` (the routes), `body.py` (an OpenAI body read through the request-field
table, etjax/request_fields.py), `bridge.py` (the engine on a thread of its own, fed through a
queue), `responses.py` (OpenAI-shaped answers and stream chunks), `metrics.py` (Prometheus
text), `errors.py` (OpenAI's error shape and the status of each failure) and `limits.py`
(what the server allows).

Its dependencies are the optional extra `serve` (Starlette and uvicorn), imported only here.
"""
