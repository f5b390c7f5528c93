"""Helpers for the server tests: a tiny model on disk, a real uvicorn server in a thread,
SSE and Prometheus text parsing.  No mocks: every request goes over TCP to 127.0.0.1."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx


def make_tiny_model(out: Path) -> Path:
    from tokenloom.model.tools.make_model import make_model

    return make_model("tiny-llama", out)


def make_tiny_adapter(base: Path, out: Path, seed: int = 0, rank: int = 4) -> Path:
    """A LoRA adapter of `base` made and saved by peft, on every projection, lora_B drawn
    non-zero (peft starts it at zero) so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def copy_without_chat_template(src: Path, dst: Path) -> Path:
    """The same model with the chat template removed from tokenizer_config.json."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (dst / extra).unlink(missing_ok=True)
    return dst


def allow_context(model: Path, max_position_embeddings: int) -> Path:
    """Let this (random-weight) model copy take a longer context, so that a request can be
    made to outlast any wait in a test however fast the machine decodes."""
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max_position_embeddings
    cfg_path.write_text(json.dumps(cfg))
    return model


def copy_with_context(src: Path, dst: Path, max_position_embeddings: int) -> Path:
    shutil.copytree(src, dst)
    return allow_context(dst, max_position_embeddings)


class ThreadedServer:
    """`tokenloom serve ARGV...` built by the real CLI parser, run by uvicorn in a thread."""

    def __init__(self, argv: list[str]):
        from tokenloom.entrypoints.cli import build_parser
        from tokenloom.entrypoints.openai.api_server import build_server

        args = build_parser().parse_args(["serve", *argv])
        args.model = args.model_tag or args.model
        self.server, self.engine = build_server(args)
        self.base_url = f"http://{args.host}:{args.port}"
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> "ThreadedServer":
        self._thread.start()
        wait_until(lambda: self.server.started or not self._thread.is_alive(), timeout)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def sse_events(lines: Iterable[str]) -> list[Any]:
    """Parse `data: ...` SSE lines into JSON objects; the terminating [DONE] becomes the string "[DONE]"."""
    events: list[Any] = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric_values(text: str, name: str, **labels: str) -> list[float]:
    """Values of every sample called `name` whose labels include `labels`."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            out.append(float(m.group(3)))
    return out


def metric(base_url: str, name: str, **labels: str) -> float:
    vals = metric_values(httpx.get(base_url + "/metrics").text, name, **labels)
    return sum(vals)
