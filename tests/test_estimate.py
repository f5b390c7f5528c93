"""The roofline estimate, checked against numbers worked out by hand.

The toy model below is small enough to count on paper:

    hidden 8, 2 layers, 2 heads, 1 kv head, head_dim 4, intermediate 16, vocab 32, untied
    embedding 32*8 = 256; per layer: q 64 + k 32 + v 32 + o 64 = 192 attention,
    3*8*16 = 384 MLP, 2*8 = 16 norm -> 592; total 256 + 2*592 + 8 + 256 (lm_head) = 1704
    streamed per step (untied input embedding is only gathered): 1704 - 256 = 1448
    layer matmul params 2*(192+384) = 1152, logits 256 -> 2 FLOPs each per token
    KV bytes/token in fp16: 2 * 2 layers * 1 kv head * 4 * 2 B = 32
    attention FLOPs per attended position: 4 * 2 layers * 2 heads * 4 = 64

and the toy hardware moves 1000 B/s and does 10000 FLOP/s at efficiency 1.
"""

from __future__ import annotations

import math

import json

import pytest

from tokenloom.entrypoints.cli import main
from tokenloom.specs import microbench
from tokenloom.sim.estimate import CostModel, estimate
from tokenloom.specs.hardware import CATALOG, DTYPES, Hardware, get_hardware
from tokenloom.specs.model_spec import ModelSpec, load_model_spec

TOY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}
TOY_HW = Hardware("toy", memory_bytes=10_000, mem_bandwidth=1000.0,
                  peak_flops={"float16": 10_000.0, "bfloat16": 10_000.0, "float32": 5_000.0}, source="test")


@pytest.fixture
def toy() -> ModelSpec:
    return ModelSpec.from_config(TOY_CONFIG, "toy")


@pytest.fixture
def cm(toy: ModelSpec) -> CostModel:
    return CostModel(toy, TOY_HW, "float16", mem_efficiency=1.0, compute_efficiency=1.0, overhead_s=0.0)


# ---------------------------------------------------------------- model arithmetic
def test_toy_counts(toy: ModelSpec) -> None:
    assert toy.embedding_params == 256
    assert toy.attention_params_per_layer == 192
    assert toy.mlp_params_per_layer == 384
    assert toy.layer_params == 592
    assert toy.total_params == 1704
    assert toy.streamed_params == 1448
    assert toy.layer_matmul_params == 1152 and toy.logits_matmul_params == 256
    assert toy.weight_bytes("float16") == 3408
    assert toy.kv_bytes_per_token("float16") == 32
    assert toy.kv_bytes_per_token("float32") == 64
    assert toy.flops_per_token(11) == 2 * 1408 + 64 * 11


def test_tied_embedding_is_streamed_as_lm_head() -> None:
    tied = ModelSpec.from_config({**TOY_CONFIG, "tie_word_embeddings": True}, "tied")
    assert tied.total_params == 1704 - 256
    assert tied.streamed_params == tied.total_params  # the embedding *is* the lm_head, read every step
    assert tied.logits_matmul_params == 256


def test_qwen2_bias_and_qwen3_qk_norm() -> None:
    qwen2 = ModelSpec.from_config({**TOY_CONFIG, "model_type": "qwen2"})
    assert qwen2.attention_params_per_layer == 192 + 8 + 4 + 4  # q/k/v biases, no o bias
    qwen3 = ModelSpec.from_config({**TOY_CONFIG, "model_type": "qwen3"})
    assert qwen3.attention_params_per_layer == 192 + 2 * 4  # q_norm + k_norm over head_dim


def test_published_parameter_counts() -> None:
    # Totals of the released checkpoints (tied embeddings counted once).
    assert load_model_spec("qwen2.5-0.5b").total_params == 494_032_768
    assert load_model_spec("qwen3-0.6b").total_params == 596_049_920
    assert load_model_spec("llama-3.2-1b").total_params == 1_235_814_400
    assert load_model_spec("llama-3-8b").total_params == 8_030_261_248
    assert load_model_spec("gemma-2-2b").total_params == 2_614_341_888
    assert load_model_spec("gemma-3-1b").total_params == 999_885_952
    assert load_model_spec("phi-3-mini-4k").total_params == 3_821_079_552


@pytest.mark.parametrize("name,extra", [
    ("tiny-llama", {}), ("tiny-mistral", {}), ("tiny-qwen2", {}), ("tiny-qwen3", {}),
    ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),
    ("tiny-qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
    ("tiny-gemma2", {}), ("tiny-gemma3", {}), ("tiny-phi3", {}),
    ("gemma-2-2b", {}), ("gemma-3-1b", {}), ("phi-3-mini-4k", {}),
])
def test_param_count_matches_transformers(name: str, extra: dict) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenloom.model.tools.presets import get_preset

    cfg = {**get_preset(name), **extra}
    with torch.device("meta"):  # shapes only, no memory
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert ModelSpec.from_config(cfg).total_params == sum(p.numel() for p in model.parameters())


def test_model_from_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TOY_CONFIG))
    assert load_model_spec(str(tmp_path)).total_params == 1704
    with pytest.raises(ValueError, match="preset"):
        load_model_spec(str(tmp_path / "missing"))


# ---------------------------------------------------------------- roofline by hand
def test_decode_batch1_by_hand(cm: CostModel) -> None:
    c = cm.decode_cost(batch_size=1, context_len=10)
    assert c.bytes == 1448 * 2 + 10 * 32 + 32  # weights + KV read + KV write = 3248
    assert c.flops == 2 * 1408 + 64 * 11  # = 3520
    assert c.mem_time_s == pytest.approx(3.248)
    assert c.compute_time_s == pytest.approx(0.352)
    assert c.time_s == pytest.approx(3.248) and c.bound == "memory"


def test_efficiency_and_overhead(toy: ModelSpec) -> None:
    cm = CostModel(toy, TOY_HW, "float16", mem_efficiency=0.5, compute_efficiency=1.0, overhead_s=0.25)
    c = cm.decode_cost(1, 10)
    assert c.mem_time_s == pytest.approx(3248 / 500)
    assert c.time_s == pytest.approx(3248 / 500 + 0.25)


def test_crossover_by_hand(cm: CostModel) -> None:
    # L = 4: F = 2816 + 64*5 = 3136 FLOPs/request, (L+1)*kv = 160 B/request, W = 2896 B.
    # 2896 + 160 B = 0.3136 * 1000 B  ->  B* = 2896 / 153.6
    b_star = cm.crossover_batch(4)
    assert b_star == pytest.approx(2896 / 153.6)
    assert cm.decode_cost(18, 4).bound == "memory"
    assert cm.decode_cost(19, 4).bound == "compute"
    at = cm.decode_cost(1, 4)
    assert (2896 + b_star * 160) / 1000 == pytest.approx(b_star * at.flops / 10_000)
    # L = 20: each request reads 21*32 = 672 B of KV (0.672 s) but does only 4160 FLOPs
    # (0.416 s), so growing the batch never makes compute catch up.
    assert cm.crossover_batch(20) is None
    assert cm.decode_cost(10_000, 20).bound == "memory"


def test_prefill_by_hand(cm: CostModel) -> None:
    c = cm.step_cost([(4, 0)], [])
    # 4 tokens through the layers, one logits row, causal attention over 1+2+3+4 = 10 positions.
    assert c.flops == 2 * 4 * 1152 + 2 * 256 + 64 * 10
    assert c.bytes == 2896 + 4 * 32
    chunked, steps = cm.prefill_cost(4, chunk_size=2)
    assert steps == 2
    # chunk 2 reads chunk 1's KV and attends 3+4 positions; weights are read twice.
    assert chunked.bytes == 2 * 2896 + 4 * 32 + 2 * 32
    assert chunked.flops == 2 * 4 * 1152 + 2 * 2 * 256 + 64 * (1 + 2 + 3 + 4)


def test_mixed_step_by_hand(cm: CostModel) -> None:
    c = cm.step_cost([(4, 0)], [10])
    assert c.bytes == 2896 + (10 + 5) * 32
    assert c.flops == 5 * 2 * 1152 + 2 * 2 * 256 + 64 * (10 + 11)
    assert cm.step_time([], []) == 0.0


def test_decode_closed_form_matches_general_step(cm: CostModel) -> None:
    for b, ctx in [(1, 0), (3, 7), (64, 100)]:
        assert cm.decode_cost(b, ctx) == pytest.approx(cm.step_cost([], [ctx] * b))


def test_estimate_report(toy: ModelSpec) -> None:
    est = estimate(toy, TOY_HW, "float16", batch_sizes=[1, 64], context_len=4, prompt_len=4,
                   mem_efficiency=1.0, compute_efficiency=1.0, overhead_s=0.0)
    d1, d64 = est.decode
    assert d1.bound == "memory" and d64.bound == "compute"
    assert d1.tokens_per_s_per_request == pytest.approx(1 / d1.step_time_s)
    assert d64.tokens_per_s_total == pytest.approx(64 / d64.step_time_s)
    assert d1.kv_read_bytes == 4 * 32 and d1.kv_write_bytes == 32
    # memory: 3408 B of weights, 160 B of KV per request of 5 tokens in 10000 B
    assert est.max_batch_in_memory == (10_000 - 3408) // 160
    assert d1.fits_in_memory and not d64.fits_in_memory
    assert est.prefill is not None and est.prefill.time_s == pytest.approx(3.024)
    json.dumps(est.to_dict())


def _qwen_4090_batch1_by_hand() -> float:
    """The seed's question 1, batch 1, kernel by kernel with the default (central) efficiencies:
    the layers' and the head's weights streamed at 0.75 of 1008 GB/s, their one-row GEMMs at
    0.78 * 1/17 of 165.2 TFLOP/s combined as the 2-norm, 1025 tokens of KV at 0.8 of the
    bandwidth, attention FLOPs at 0.3 of the peak, 24 layers x 10 us, 0.3 ms + 10 us of host."""
    from math import hypot

    bw, peak = 1008e9, 165.2e12
    head_bytes = 2 * 151_936 * 896  # the tied embedding, read in full as the head
    layers_bytes = 2 * 494_032_768 - head_bytes  # the layers' linears, norms and biases
    w_layers = layers_bytes / (bw * 0.75)
    g_layers = 2 * 357_826_560 / (peak * 0.78 / 17)  # 24 x (2*896*896 + 2*896*128 + 3*896*4864) matmul params
    w_head = head_bytes / (bw * 0.75)
    g_head = 2 * 151_936 * 896 / (peak * 0.78 / 17)
    attention = 1025 * 12_288 / (bw * 0.8) + 1025 * 4 * 24 * 14 * 64 / (peak * 0.3)
    return hypot(w_layers, g_layers) + hypot(w_head, g_head) + attention + 24 * 10e-6 + 0.3e-3 + 10e-6


def test_seed_question_rtx4090_qwen_0_5b() -> None:
    """The seed's question 1 at batch 1: ~1 GB of weights streamed per token, ~1.9 ms/token."""
    spec = load_model_spec("qwen2.5-0.5b")
    cm = CostModel(spec, get_hardware("rtx4090"), "float16")
    c = cm.decode_cost(1, 1024)
    expected_bytes = 494_032_768 * 2 + 1025 * 12_288
    assert c.bytes == expected_bytes
    assert c.time_s == pytest.approx(_qwen_4090_batch1_by_hand(), rel=1e-9)
    assert c.bound == "memory"
    assert 450 < 1 / c.time_s < 650  # tokens/s for one request
    # the plain roofline of the seed's first answer is still there, by hand
    plain = CostModel(spec, get_hardware("rtx4090"), "float16", mem_efficiency=0.8, compute_efficiency=0.6)
    assert plain.decode_cost(1, 1024).time_s == pytest.approx(expected_bytes / (1008e9 * 0.8))


# ---------------------------------------------------------------- catalog
def test_catalog_complete_and_cited() -> None:
    for name in ("rtx4090", "rtx3090", "l4", "a100-40gb", "a100-80gb", "h100-sxm", "h200"):
        hw = get_hardware(name)
        assert hw.name == name and not hw.measured
        assert set(DTYPES) <= set(hw.peak_flops) and all(v > 0 for v in hw.peak_flops.values())
        assert hw.mem_bandwidth > 1e11 and hw.memory_bytes >= 16 * 2**30
        assert "http" in hw.source
    assert len(CATALOG) >= 7
    r = CATALOG["rtx4090"]
    assert (r.mem_bandwidth, r.peak_flops["float16"], r.peak_flops["float32"]) == (1008e9, 165.2e12, 82.6e12)
    assert get_hardware("RTX4090") is r
    with pytest.raises(KeyError, match="known: .*rtx4090.*local"):
        get_hardware("tpu-v9")


# ---------------------------------------------------------------- microbenchmarks
def test_microbench_functions_measure_something() -> None:
    assert microbench.measure_bandwidth(nbytes=4 * 2**20, repeats=2) > 1e8
    assert microbench.measure_copy_bandwidth(nbytes=4 * 2**20, repeats=2) > 1e8
    llc = microbench.last_level_cache_bytes()
    assert llc is None or llc > 0
    assert microbench.default_buffer_bytes() >= min(2**30, microbench._memory_bytes("cpu") // 8)
    assert microbench.measure_matmul_flops("float32", n=64, repeats=2) > 1e6
    assert 0 < microbench.measure_op_overhead(num_ops=50, repeats=2) < 1e-2


def test_bandwidth_without_our_kernel_reads_through_torch(monkeypatch) -> None:
    from tokenloom.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "stream_read", lambda x: None)  # as where the kernels cannot build
    # a figure, finite and positive: not a speed (a machine loaded by other work reads 2 MiB slowly)
    bandwidth = microbench.measure_bandwidth(nbytes=2 * 2**20 + 12, repeats=2)
    assert math.isfinite(bandwidth) and bandwidth > 1e6


@pytest.mark.parametrize("nbytes", [0, 1, 31, 33, 4096 + 7, 3 * 2**18 + 1000 * 32 + 5, 2**21 + 64])
def test_stream_read_sums_every_byte(nbytes: int, monkeypatch) -> None:
    import torch

    from tokenloom.kernels import cpu as cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("our CPU kernels do not build here")
    # Three threads: the per-thread runs split a vector count that is not a multiple of them.
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        g = torch.Generator().manual_seed(nbytes)
        x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        got = cpu_kernels.stream_read(x)
        assert got.dtype == torch.long and got.dim() == 0 and int(got) == int(x.sum())
        if nbytes % 4 == 0 and nbytes:  # any dtype: its bytes; a strided view: its elements' bytes
            f = x.view(torch.float32)
            assert int(cpu_kernels.stream_read(f)) == int(x.sum())
            assert int(cpu_kernels.stream_read(f[::3])) == int(f[::3].contiguous().view(torch.uint8).sum())
    finally:
        torch.set_num_threads(threads)


def test_local_measurements_are_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(microbench, "measure_bandwidth", lambda **kw: calls.append("bw") or 2e10)
    monkeypatch.setattr(microbench, "measure_copy_bandwidth", lambda **kw: calls.append("copy") or 1.5e10)
    monkeypatch.setattr(microbench, "measure_matmul_flops", lambda name, **kw: 1e11)
    monkeypatch.setattr(microbench, "measure_op_overhead", lambda **kw: 5e-6)
    hw = get_hardware("local")
    assert hw.measured and hw.mem_bandwidth == 2e10 and hw.peak_flops["bfloat16"] == 1e11
    assert calls == ["bw", "copy"]
    assert get_hardware("local").mem_bandwidth == 2e10 and calls == ["bw", "copy"]  # from the cache file
    record = microbench.measure_local()  # the read rate is the roof, the copy rate kept beside it
    assert (record["mem_bandwidth"], record["copy_bandwidth"]) == (2e10, 1.5e10)
    assert (tmp_path / "microbench.json").is_file()
    get_hardware("local", refresh_local=True)
    assert calls == ["bw", "copy", "bw", "copy"]
    spec = ModelSpec.from_config(TOY_CONFIG)
    assert CostModel(spec, hw, "float32").overhead_s == pytest.approx(5e-6 * spec.eager_ops_per_step)


# ---------------------------------------------------------------- CLI
def test_cli_estimate_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "est.json"
    rc = main(["estimate", "--hardware", "rtx4090", "--model", "qwen2.5-0.5b", "--dtype", "float16",
               "--batch-size", "1,8,256", "--context-len", "1024", "--prompt-len", "512",
               "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "memory-bound" in text and "crossover" in text and "TTFT" in text
    data = json.loads(out.read_text())
    assert [d["batch_size"] for d in data["decode"]] == [1, 8, 256]
    assert data["decode"][0]["step_time_s"] == pytest.approx(_qwen_4090_batch1_by_hand(), rel=1e-9)
    fast, slow = data["decode"][0]["step_time_band_s"]  # engines of greater and lesser quality
    assert fast < data["decode"][0]["step_time_s"] < slow
    assert data["prefill"]["prompt_len"] == 512
    assert data["hardware"]["name"] == "rtx4090" and data["dtype"] == "float16"


def test_cli_estimate_model_dir_and_errors(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TOY_CONFIG))
    assert main(["estimate", "--hardware", "l4", "--model", str(tmp_path), "--batch-size", "1,4",
                 "--context-len", "4", "--prompt-len", "0", "--overhead-ms", "1"]) == 0
    assert "host 1 ms/step" in capsys.readouterr().out
    assert main(["estimate", "--hardware", "nope"]) == 2
    assert "known:" in capsys.readouterr().err  # errors go to stderr, as every command's do
    assert main(["estimate", "--list-hardware"]) == 0
    assert "h200" in capsys.readouterr().out
