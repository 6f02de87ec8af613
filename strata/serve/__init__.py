"""The HTTP layer: an OpenAI-compatible Starlette app (app.py), the wire format (openai_api.py), and the hypercorn
runner (server.py). `strata serve` is the command line's way in."""
from strata.serve.app import create_app

__all__ = ["create_app"]
