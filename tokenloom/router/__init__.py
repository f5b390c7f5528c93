"""Spreading requests over several engines: routing policies (`policy`, pure Python, shared
with the simulator), the OpenAI passthrough in front of the backends (`app`), their health
(`health`), the router's metrics (`metrics`) and its uvicorn server (`server`).

Used by `tokenloom router --backend URL ...` and `tokenloom serve --data-parallel-size N`.
"""
