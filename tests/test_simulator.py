"""The simulator: the real Scheduler + KV cache, on a clock advanced by the CostModel.

Small scenarios are checked against clocks worked out from `CostModel.step_time` by hand;
bigger ones check determinism, speed (1000 requests) and the CLI's report.
"""

from __future__ import annotations

import json

import pytest

from tokenloom.measure.metrics import summarize
from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, generate_workload
from tokenloom.entrypoints.cli import main
from tokenloom.sim.estimate import CostModel
from tokenloom.specs.hardware import Hardware, get_hardware
from tokenloom.specs.model_spec import ModelSpec, load_model_spec
from tokenloom.sim.simulator import SimConfig, Simulator, num_kv_blocks_for, simulate

TOY = ModelSpec.from_config({
    "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32,
}, "toy")
TOY_HW = Hardware("toy", 10**6, 1000.0, {"float16": 1e4, "bfloat16": 1e4, "float32": 5e3}, "test")
SMALL = SimConfig(max_model_len=64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture
def cm() -> CostModel:
    return CostModel(TOY, TOY_HW, "float16", mem_efficiency=1.0, compute_efficiency=1.0, overhead_s=0.01)


def _req(prompt_len: int, out: int, t: float = 0.0, first: int = 5) -> BenchRequest:
    return BenchRequest(list(range(first, first + prompt_len)), out, t)


def test_one_request_clock_by_hand(cm: CostModel) -> None:
    """Prefill 4 tokens (samples token 1), then decodes at KV lengths 4 and 5."""
    res = simulate([_req(4, 3)], cm, SMALL)
    t1 = cm.step_time([(4, 0)], [])
    t2 = cm.step_time([], [4])
    t3 = cm.step_time([], [5])
    r = res.records[0]
    assert r.success and r.output_len == 3
    assert r.token_times == pytest.approx([t1, t1 + t2, t1 + t2 + t3])
    assert r.first_token_time == pytest.approx(t1) and r.end_time == pytest.approx(t1 + t2 + t3)
    assert res.duration_s == pytest.approx(t1 + t2 + t3)
    assert res.steps.num_seqs == [1, 1, 1] and res.steps.num_decode == [0, 1, 1]


def test_continuous_batching_shares_steps(cm: CostModel) -> None:
    """Two requests at t=0: both prefills in step 1, then one step decodes both (seed: 'step1: A B')."""
    res = simulate([_req(4, 3), _req(6, 2, first=20)], cm, SMALL)
    assert res.steps.num_seqs == [2, 2, 1]
    t1 = cm.step_time([(4, 0), (6, 0)], [])
    t2 = cm.step_time([], [4, 6])
    t3 = cm.step_time([], [5])
    a, b = res.records
    assert a.token_times == pytest.approx([t1, t1 + t2, t1 + t2 + t3])
    assert b.token_times == pytest.approx([t1, t1 + t2])


def test_max_num_seqs_makes_the_second_request_wait(cm: CostModel) -> None:
    cfg = SimConfig(max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    res = simulate([_req(4, 2), _req(4, 2, first=20)], cm, cfg)
    a, b = res.records
    assert res.steps.num_seqs == [1, 1, 1, 1]
    assert b.first_token_time > a.end_time  # TTFT includes queueing behind A


def test_chunked_prefill_is_charged_per_chunk(cm: CostModel) -> None:
    cfg = SimConfig(max_model_len=64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=4)
    events = []
    res = simulate([_req(10, 1)], cm, cfg, observers=[events.append])
    assert [e.entries[0].phase for e in events] == ["prefill_chunk"] * 3
    expected = cm.step_time([(4, 0)], []) + cm.step_time([(4, 4)], []) + cm.step_time([(2, 8)], [])
    assert res.records[0].first_token_time == pytest.approx(expected)


def test_idle_engine_waits_for_the_next_arrival(cm: CostModel) -> None:
    res = simulate([_req(4, 2), _req(4, 2, t=100.0, first=20)], cm, SMALL)
    b = res.records[1]
    assert b.first_token_time - b.arrival_time == pytest.approx(cm.step_time([(4, 0)], []))
    assert res.duration_s > 100.0


def test_preemption_under_kv_pressure_finishes_everything(cm: CostModel) -> None:
    # 8 blocks of 4 tokens = 32 tokens of KV for 6 requests that each grow to 20 tokens.
    cfg = SimConfig(max_model_len=32, block_size=4, num_kv_blocks=8, max_num_batched_tokens=64,
                    enable_prefix_caching=False)
    reqs = [_req(8, 12, first=5 + i) for i in range(6)]
    res = simulate(reqs, cm, cfg)
    assert res.num_preemptions > 0
    assert all(r.success and r.output_len == 12 for r in res.records)
    assert res.steps.kv_usage[-1] == 0.0  # every block back in the pool


def test_prefix_caching_skips_shared_prefix(cm: CostModel) -> None:
    shared = list(range(5, 21))  # 16 tokens = 4 full blocks
    reqs = [BenchRequest(shared + [30], 1, 0.0), BenchRequest(shared + [31], 1, 100.0)]  # B after A is done
    res = simulate(reqs, cm, SMALL)
    assert res.prefix_cache_hit_rate > 0.4
    second = res.records[1]
    assert second.first_token_time - 100.0 == pytest.approx(cm.step_time([(1, 16)], []))


def test_too_long_request_fails_alone(cm: CostModel) -> None:
    res = simulate([_req(60, 10), _req(4, 2)], cm, SMALL)
    assert not res.records[0].success and "max_model_len" in res.records[0].error
    assert res.records[1].success


def test_kv_blocks_from_device_memory() -> None:
    spec = load_model_spec("qwen2.5-0.5b")
    cm = CostModel(spec, get_hardware("rtx4090"), "float16")
    blocks = num_kv_blocks_for(SimConfig(), cm)
    assert blocks == int((int(24 * 2**30 * 0.9) - spec.weight_bytes("float16")) // (16 * 12_288))
    assert num_kv_blocks_for(SimConfig(kv_cache_memory="1GiB"), cm) == 2**30 // (16 * 12_288)
    big = CostModel(load_model_spec("llama-3-8b"), get_hardware("l4"), "float32")
    with pytest.raises(ValueError, match="does not fit"):
        num_kv_blocks_for(SimConfig(), big)


def _workload(n: int, seed: int = 0, rate: float = 200.0) -> list[BenchRequest]:
    return generate_workload(WorkloadSpec(name="sharegpt-like", num_prompts=n, input_len=(16, 512),
                                          output_len=(8, 128), seed=seed, vocab_range=(5, 151936),
                                          request_rate=rate))


def test_deterministic_for_a_seed() -> None:
    cm = CostModel(load_model_spec("qwen2.5-0.5b"), get_hardware("l4"))
    cfg = SimConfig(max_model_len=2048, kv_cache_memory="64MiB", max_num_batched_tokens=512)
    runs = [Simulator(cm, cfg).run(_workload(150), seed=3) for _ in range(2)]
    assert [r.token_times for r in runs[0].records] == [r.token_times for r in runs[1].records]
    assert runs[0].steps.num_seqs == runs[1].steps.num_seqs
    other = Simulator(cm, cfg).run(_workload(150, seed=1), seed=3)
    assert [r.token_times for r in other.records] != [r.token_times for r in runs[0].records]


@pytest.mark.timeout(60)  # the brief: 1000 requests in well under a minute
def test_thousand_requests_simulate_quickly() -> None:
    cm = CostModel(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"))
    cfg = SimConfig(max_model_len=4096, kv_cache_memory="8GiB")
    res = Simulator(cm, cfg).run(_workload(1000, rate=50.0))
    s = summarize(res.records, duration=res.duration_s)
    assert s.completed == 1000 and s.failed == 0
    assert s.total_output_tokens == sum(r.output_len for r in res.records)
    assert s.ttft_ms.count == 1000 and s.tpot_ms.mean > 0
    # Each step can be no faster than streaming the ~15 GB of weights once.
    assert min(res.steps.durations) >= cm.weight_bytes / (3.35e12 * 0.8)


def test_cli_simulate_writes_bench_shaped_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--hardware", "a100-80gb", "--model", "qwen3-0.6b", "--num-prompts", "40",
               "--workload", "mixed-long", "--long-len", "1024", "--input-len", "16:64", "--output-len", "8:32",
               "--request-rate", "20", "--max-num-batched-tokens", "256", "--max-model-len", "2048",
               "--kv-cache-memory", "256MiB", "--show-steps", "3", "--goodput", "ttft:200",
               "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "step    1" in text and "TTFT" in text and "long" in text
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "simulate" and doc["machine"]["simulated"] is True
    summary = doc["results"]["summary"]
    assert summary["completed"] == 40 and "p95" in summary["ttft_ms"] and summary["goodput"] is not None
    assert set(doc["results"]["groups"]) == {"short", "long"}
    assert len(doc["requests"]) == 40
    assert doc["config"]["scheduler"]["max_num_batched_tokens"] == 256
