"""The model id a server answers to when `--served-model-name` is not given.

vLLM serves a model under the `model` argument as given, which suits a hub id
(`Qwen/Qwen2.5-0.5B-Instruct`) but not a filesystem path: an id like `/tmp/models/tiny`
ends up in client code as `openai//tmp/models/tiny` (LiteLLM's provider prefix) and in
every response and metric label.  So a model given as a path (absolute, `./`, `../` or `~`)
is served under its directory's name, and the path as given (and resolved) stays accepted
in requests as an alias; a hub id, or a relative name that reads like one, is kept as given;
the bundled model is `tokenloom/py-tiny`.
"""

from __future__ import annotations

from pathlib import Path


def default_served_names(model_arg: str | None, model_name: str) -> tuple[list[str], list[str]]:
    """(names listed by /v1/models, further names accepted in requests) for a server started
    without `--served-model-name`.  `model_arg`: the MODEL argument (None: the bundled model);
    `model_name`: the engine's name for it."""
    if model_arg is None:
        return [model_name], []
    looks_like_path = model_arg.startswith(("/", "./", "../", "~")) or model_arg in (".", "..")
    path = Path(model_arg).expanduser()
    if not looks_like_path or not path.is_dir():
        return [model_arg], []
    resolved = path.resolve()
    name = resolved.name or model_arg
    aliases = [a for a in dict.fromkeys([model_arg, model_arg.rstrip("/"), str(resolved)]) if a and a != name]
    return [name], aliases
