"""`dsv4-chat serve`: the engine behind an OpenAI-compatible HTTP API (Starlette + uvicorn).

Modules: request (parse and validate a chat request), stops (stop strings), errors (OpenAI-style
error bodies), pool (sessions reused across requests), worker (the one generation thread),
api (routes), runner (uvicorn, with a shutdown that ends every request), cli (the `serve`
subcommand).
"""
