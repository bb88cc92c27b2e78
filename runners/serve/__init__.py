"""The OpenAI-compatible HTTP server (``dsv4 serve``): FastAPI + uvicorn over one engine loop.

``protocol`` and ``responses`` are the request and response models (the published OpenAPI
schema); ``app`` the routes; ``completions`` and ``chat`` the two generation endpoints over
``generation`` (one HTTP request's engine requests); ``engine_loop`` the one thread that owns the
``LLM``; ``metrics`` the Prometheus metrics; ``server`` runs it all under uvicorn.
"""

from runners.serve.app import build_app
from runners.serve.context import ServerContext, ServerSettings
from runners.serve.engine_loop import EngineDeadError, EngineLoop
from runners.serve.metrics import Metrics
from runners.serve.server import bind, serve

__all__ = [
    "EngineDeadError",
    "EngineLoop",
    "Metrics",
    "ServerContext",
    "ServerSettings",
    "bind",
    "build_app",
    "serve",
]
