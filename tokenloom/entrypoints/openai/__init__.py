"""The OpenAI-compatible HTTP server (`tokenloom serve`): protocol models, routes, SSE streaming.

Entry point: `api_server.build_server(args)`; the engine side is `tokenloom.engine.async_engine`.
"""
