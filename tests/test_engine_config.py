"""One resolved `EngineConfig`: the engine runs with it, and the simulator and benchmarks
resolve the same one from the same flags (no copied defaults)."""

from __future__ import annotations

import json

import pytest

from tokenloom import LLM, EngineArgs
from tokenloom.config import EngineConfig, ModelShape, default_kv_cache_bytes, resolve_max_model_len
from tokenloom.model.tools.presets import get_preset
from tokenloom.sim.simulator import SimConfig
from tokenloom.specs.model_spec import load_model_shape, load_model_spec, model_shape

SHAPE = ModelShape(max_position_embeddings=1024, num_layers=2, num_kv_heads=2, head_dim=16)


def _resolve(**kw) -> EngineConfig:
    return EngineConfig.resolve(EngineArgs(**kw), SHAPE, model="/m", model_name="m", device="cpu", dtype="float32",
                                free_memory_bytes=lambda: 2**30)


def test_engine_runs_with_the_config_the_simulator_resolves(tiny_llama):
    """The engine's KV blocks, budgets and lengths are `EngineConfig.resolve` of its flags, and
    resolving the same flags torch-free (as `simulate --compare-with` does) gives the same."""
    flags = dict(max_model_len=192, block_size=8, kv_cache_memory="1MiB", max_num_seqs=5,
                 enable_chunked_prefill=False)
    eng = LLM(str(tiny_llama), **flags).llm_engine
    c = eng.config
    again = EngineConfig.resolve(EngineArgs(model=str(tiny_llama), **flags), load_model_shape(str(tiny_llama)),
                                 model=str(tiny_llama), model_name=str(tiny_llama), device="cpu", dtype=c.dtype)
    assert again == c
    assert c.kv_blocks_from == "--kv-cache-memory"
    assert c.num_kv_blocks == 2**20 // c.kv_bytes_per_block
    assert c.max_num_batched_tokens == max(192, 2048)  # without chunking: at least the whole context
    # What the engine built is what the config says.
    assert eng.kv.num_blocks == c.num_kv_blocks and eng.runner.block_size == c.block_size
    assert eng.runner.kv_cache_bytes == c.kv_cache_bytes
    assert eng.scheduler.config == c.scheduler and eng.max_model_len == c.max_model_len == 192
    sim = SimConfig.from_engine_config(c)
    assert (sim.num_kv_blocks, sim.max_num_batched_tokens, sim.max_model_len, sim.enable_chunked_prefill) == (
        c.num_kv_blocks, c.max_num_batched_tokens, 192, False)


def test_compare_with_rebuilds_the_engine_config_from_the_bench_json(tiny_llama):
    """`simulate --compare-with` reads the recorded flags through `EngineConfig.resolve`:
    unrecorded (null) flags take the engine's own defaults."""
    from tokenloom.sim.validate import inputs_from_bench

    model = str(tiny_llama)
    recorded = {"launch": model, "dtype": "float32", "max_num_seqs": 3, "max_model_len": 128, "block_size": None,
                "max_num_batched_tokens": None, "kv_cache_memory": "512KiB", "num_kv_blocks": None}
    doc = {"benchmark": "serve", "config": recorded,
           "workload": {"spec": {"name": "random", "num_prompts": 2, "input_len": [4, 4], "output_len": [2, 2],
                                 "vocab_range": [5, 100], "seed": 0}}}
    inp = inputs_from_bench(json.loads(json.dumps(doc)))
    want = EngineConfig.resolve(EngineArgs(max_num_seqs=3, max_model_len=128, kv_cache_memory="512KiB"),
                                load_model_shape(model), model=model, model_name=model, device="cpu",
                                dtype="float32")
    assert inp.sim_config == SimConfig.from_engine_config(want)
    assert inp.sim_config.block_size == EngineArgs().block_size
    assert inp.kv_blocks_note == "--kv-cache-memory"


def test_max_position_embeddings_comes_from_the_parsed_model_args():
    """A config.json without max_position_embeddings means the family's default (Qwen2: 32768),
    not a generic fallback."""
    cfg = get_preset("tiny-qwen2")
    del cfg["max_position_embeddings"]
    assert model_shape(cfg).max_position_embeddings == 32768
    cfg = get_preset("tiny-llama")
    del cfg["max_position_embeddings"]
    assert model_shape(cfg).max_position_embeddings == 2048
    spec = load_model_spec("qwen2.5-0.5b")
    shape = load_model_shape("qwen2.5-0.5b")
    assert shape.kv_bytes_per_block(16, "bfloat16") == 16 * spec.kv_bytes_per_token("bfloat16")


def test_defaults_are_decided_once():
    c = _resolve()
    assert c.max_model_len == 1024 and c.max_num_seqs == EngineArgs().max_num_seqs
    assert c.max_num_batched_tokens == 2048 and c.kv_blocks_from == "default"
    # The default KV budget never exceeds what max_num_seqs full-length requests can use...
    assert c.num_kv_blocks == EngineArgs().max_num_seqs * 1024 // 16
    # ...and otherwise is a quarter of the available RAM, at most 4 GiB.
    small = EngineConfig.resolve(EngineArgs(), SHAPE, model="/m", model_name="m", device="cpu", dtype="float32",
                                 free_memory_bytes=lambda: 2**24)
    assert small.num_kv_blocks == 2**22 // SHAPE.kv_bytes_per_block(16, "float32")
    assert default_kv_cache_bytes("cpu", 2**40) == 4 * 2**30
    assert default_kv_cache_bytes("cuda:0", 1000) == 850
    with pytest.raises(ValueError, match="free device memory"):
        default_kv_cache_bytes("cuda")
    assert _resolve(num_kv_blocks=77).num_kv_blocks == 77


def test_limits_are_checked_once():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        resolve_max_model_len(2048, 1024)
    with pytest.raises(ValueError, match="num-kv-blocks"):
        _resolve(max_model_len=512, num_kv_blocks=2)
    with pytest.raises(ValueError, match="block-size"):
        _resolve(block_size=0)
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        _resolve(enable_chunked_prefill=False, max_num_batched_tokens=64, num_kv_blocks=100)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.resolve(EngineArgs(), SHAPE, model="/m", model_name="m", device="cpu", dtype="int8")
