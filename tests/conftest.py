"""Shared fixtures: tiny random-weight models made by `tokenloom make-model` (once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep tests from fighting over the two cores: torch's intra-op pool per test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter (read at import).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    # Selectable (`-m soak`, `-m "not soak"`); it runs with the rest of the suite by default.
    config.addinivalue_line("markers", "soak: the bounded soak of a real server (tests/test_soak.py)")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    from tokenloom.model.tools.make_model import make_model

    made: dict[str, Path] = {}

    def get(preset: str = "tiny-llama", **kw) -> Path:
        key = preset + repr(sorted(kw.items()))
        if key not in made:
            out = tmp_path_factory.mktemp(preset.replace(".", "_"))
            made[key] = make_model(preset, out, **kw)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("tiny-llama")
