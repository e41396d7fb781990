"""`specdec serve`: an OpenAI-compatible HTTP server that speculates (FastAPI + uvicorn), with llama-server's knobs.

app.py: routes (create_app); schemas.py: request validation and OpenAI error bodies; scheduler.py: the engine loop
(continuous batching over engine.Engine, a bounded queue, cancellation); metrics.py: Prometheus metrics.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path

from .app import ServerConfig, create_app
from .scheduler import Backend, Scheduler


def make_backend(target, draft=None, spec=None, mtp=None, requested: str | None = None) -> Backend:
    """A Backend around loaded models: its model id (the alias or file name the server was started with) and the
    names requests may use for it; MTP heads are resolved once here when the model has them, so a request may
    ask for `speculative.type: mtp` whatever the server's default."""
    from ..spec import SpecConfig, resolve_mtp

    spec = spec or SpecConfig(kind="draft" if draft is not None else "none")
    if mtp is None:
        try:
            mtp = resolve_mtp(target, spec.heads)
        except Exception:  # heads that do not fit this model: only an error when mtp is the server's own mode
            if spec.kind == "mtp":
                raise
            mtp = None
        mtp = mtp or ()  # (): resolved, the model has none (never looked up again per request)
    path = Path(target.path)
    model_id = requested if requested and not Path(requested).exists() else path.name
    names = {model_id, path.name, path.stem, str(path), requested or "", "smollm2" if requested is None else ""}
    return Backend(target, draft, spec, mtp, model_id, frozenset(n for n in names if n))


def serve(load: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8080, parallel: int = 4,
          max_queue: int | None = None, api_key: str | None = None, model: str | None = None,
          prompt_cache: bool = True) -> int:
    """Run the server until interrupted. load() -> (spec, target, draft or None, mtp or None) runs in a background
    thread once the server listens (/health is 503 until it returns). Returns the exit code."""
    import uvicorn

    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {port}")
    config = ServerConfig(parallel=parallel, max_queue=max_queue, api_key=api_key, prompt_cache=prompt_cache)
    if parallel < 1:
        raise ValueError("--parallel must be >= 1")
    if max_queue is not None and max_queue < 1:
        raise ValueError("--max-queue must be >= 1")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def build() -> Backend:
        spec, target, draft, mtp = load()
        return make_backend(target, draft, spec, mtp, model)

    def on_error(e: BaseException) -> None:
        print(f"error: {e}", file=sys.stderr)
        failed.append(e)
        if server is not None:
            server.should_exit = True

    def on_ready(b: Backend) -> None:
        mtp = f", mtp heads: {b.mtp[3]}" if b.mtp else ""
        print(f"specdec serve: {b.model_id} ready | {b.target.load_summary()} | speculation {b.spec.kind} (per "
              f"request: {', '.join(b.spec_kinds)}{mtp}) | {parallel} slots, queue {config.max_queue or 4 * parallel}"
              f" | http://{host}:{port}/v1", file=sys.stderr)

    app = create_app(build, config, on_ready, on_error)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C / SIGTERM: end the streams now, then shut down
            sched = app.state.specdec.scheduler
            if sched is not None:
                sched.shutdown_soon()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5, lifespan="on"))
    try:  # bound here, so that a port in use or a bad host is one line before anything says it listens
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        why = (e.strerror or str(e)).split(" (while attempting")[0]
        raise OSError(f"cannot listen on {host}:{port} ({why}): give another --host / --port") from None
    print(f"specdec serve: listening on http://{host}:{port} (loading the model; /health is 503 until it is "
          "ready)", file=sys.stderr)
    server.run(sockets=[sock])
    if failed or not server.started:
        return 1
    return 0


__all__ = ["Backend", "Scheduler", "ServerConfig", "create_app", "make_backend", "serve"]
