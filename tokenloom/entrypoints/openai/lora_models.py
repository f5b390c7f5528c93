"""The LoRA adapters a server serves by name (`--enable-lora`).

A request picks an adapter by naming it as its `model`; /v1/models lists each adapter with
the base model as its `parent`.  Adapters come from `--lora-modules name=path ...` at start
and from POST /v1/load_lora_adapter / /v1/unload_lora_adapter while serving (vLLM's routes;
under /v1, so --api-key guards them).  Each load gets a fresh id, never reused, so an
adapter loaded again under the same name never meets its predecessor's prefix-cache
blocks or weight slot; unloading takes the name away from new requests while the
requests already running on the adapter finish with it.

Statuses: 404 when there is no adapter at the path (or none of that name to unload), 400
naming the field for an adapter this engine cannot run, 409 for a name already served.
"""

from __future__ import annotations

import asyncio
import itertools
import json

from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.openai.errors import OpenAIError, bad_request
from tokenloom.request import LoRARequest


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules` items, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, as
    (name, path) pairs; ValueError naming the flag for anything else."""
    out: list[tuple[str, str]] = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            name, path = (obj.get("name"), obj.get("path")) if isinstance(obj, dict) else (None, None)
        else:
            name, sep, path = item.partition("=")
            if not sep:
                name = path = None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {item!r} is not name=path (or {{\"name\": ..., \"path\": ...}})")
        out.append((name, path))
    names = [n for n, _ in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"--lora-modules: the name {dup!r} is given twice")
    return out


class LoRAModels:
    """Adapter name -> `LoRARequest`, beside the base model's served names."""

    def __init__(self, engine: AsyncLLMEngine, base_names: list[str], reserved: list[str] | tuple = ()):
        self.engine = engine
        self.base_name = base_names[0]
        self._taken = set(base_names) | set(reserved)  # names the base model answers to
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.engine.engine.lora_config is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None

    def _new(self, name: str, path: str) -> LoRARequest:
        if not self.enabled:
            raise bad_request("LoRA adapters need a server started with --enable-lora", param="lora_name",
                              code="unsupported")
        if name in self._taken or name in self.by_name:
            raise OpenAIError(409, f"the name {name!r} is already served (by the base model or another adapter); "
                                   f"unload it first or pick another", param="lora_name", code="name_taken")
        return LoRARequest(name, next(self._ids), path, base_model_name=self.base_name)

    def _add(self, lr: LoRARequest, adapter) -> None:
        if lr.lora_name in self.by_name:  # another load of the name finished first, while this one read
            raise OpenAIError(409, f"the name {lr.lora_name!r} is already served", param="lora_name",
                              code="name_taken")
        self.engine.engine.add_lora(lr, adapter)
        self.by_name[lr.lora_name] = lr

    def load_now(self, name: str, path: str) -> LoRARequest:
        """Load at start-up (`--lora-modules`): errors raise as they are (the CLI's error line)."""
        if not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        if name in self._taken or name in self.by_name:
            raise ValueError(f"--lora-modules: the name {name!r} is already served")
        lr = LoRARequest(name, next(self._ids), path, base_model_name=self.base_name)
        self._add(lr, self.engine.engine.load_lora(lr))
        return lr

    async def load(self, name: str, path: str) -> LoRARequest:
        """Read the adapter off the event loop, then serve it under `name`."""
        lr = self._new(name, path)
        try:
            adapter = await asyncio.to_thread(self.engine.engine.load_lora, lr)
        except FileNotFoundError as e:
            raise OpenAIError(404, str(e), param="lora_path", code="adapter_not_found") from None
        except (ValueError, OSError) as e:
            raise bad_request(f"the adapter at lora_path cannot run on this server: {e}", param="lora_path") from None
        self._add(lr, adapter)
        return lr

    def unload(self, name: str) -> LoRARequest:
        lr = self.by_name.pop(name, None)
        if lr is None:
            raise OpenAIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                              code="adapter_not_found")
        self.engine.engine.remove_lora(lr.lora_int_id)
        return lr
