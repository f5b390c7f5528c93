"""Simulator validation: the comparison math, the calibration fit, and the simulator
reproducing the real engine's step-by-step batches.

The last one is the heart of "the simulator runs the real scheduler": with a clock that
charges every step the same time, the simulator and a real `LLM` on a tiny model, fed
the same requests at the same steps under the same limits, must batch the same
requests in the same steps with the same token counts -- chunking and preemption
included.
"""

from __future__ import annotations

import dataclasses

import json
import math

import pytest

from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, generate_workload, workload_stats
from tokenloom.sim.calibrate import calibration_key
from tokenloom.sim.engine_cost import Calibration, EngineCostModel
from tokenloom.sim.engine_cost import predict as _predict
from tokenloom.sim.fit import fit
from tokenloom.sim.step_features import StepFeatures
from tokenloom.sim.estimate import CostModel
from tokenloom.specs.hardware import get_hardware
from tokenloom.specs.model_spec import load_model_spec
from tokenloom.sim.simulator import SimConfig, Simulator
from tokenloom.sim.validate import (MetricComparison, all_targets_ok, compare, markdown_table, metric_value,
                                    rebuild_requests, relative_error)


# ---------------------------------------------------------------- error math
def test_relative_error_is_signed_and_relative_to_the_measurement() -> None:
    assert relative_error(100.0, 110.0) == pytest.approx(0.10)
    assert relative_error(200.0, 170.0) == pytest.approx(-0.15)
    assert relative_error(50.0, 50.0) == 0.0
    assert math.isnan(relative_error(0.0, 5.0))
    assert math.isnan(relative_error(math.nan, 5.0)) and math.isnan(relative_error(5.0, math.nan))


def _summary(ttft_med: float, tpot_med: float, tpot_p95: float, out_tps: float) -> dict:
    return {"ttft_ms": {"median": ttft_med, "p95": 2 * ttft_med}, "tpot_ms": {"median": tpot_med, "p95": tpot_p95},
            "itl_ms": {"median": tpot_med}, "e2el_ms": {"median": 10 * tpot_med}, "output_throughput": out_tps,
            "duration_s": 30.0}


def test_compare_rows_tolerance_and_verdict() -> None:
    measured = _summary(1000.0, 200.0, 400.0, 50.0)
    simulated = _summary(1150.0, 180.0, 470.0, 50.0)  # +15%, -10%, +17.5%, 0%
    rows = {r.key: r for r in compare(measured, simulated)}
    assert rows["ttft_median"].rel_error == pytest.approx(0.15) and rows["ttft_median"].ok  # the bound is inclusive
    assert rows["tpot_median"].rel_error == pytest.approx(-0.10) and rows["tpot_median"].ok
    assert rows["tpot_p95"].rel_error == pytest.approx(0.175) and not rows["tpot_p95"].ok
    assert rows["output_throughput"].rel_error == 0.0
    assert [r.key for r in compare(measured, simulated) if r.target] == [
        "ttft_median", "tpot_median", "tpot_p95", "output_throughput"]
    assert not all_targets_ok(list(rows.values()))
    assert all_targets_ok(compare(measured, simulated, tolerance=0.2))
    # A context row out of tolerance does not fail the verdict; a missing headline figure does.
    assert all_targets_ok(compare(measured, {**simulated, "duration_s": 99.0}, tolerance=0.2))
    missing = {k: v for k, v in simulated.items() if k != "output_throughput"}
    assert not all_targets_ok(compare(measured, missing, tolerance=0.2))
    assert math.isnan(metric_value(missing, ("output_throughput",)))
    assert metric_value({"a": {"b": None}}, ("a", "b")) != metric_value({"a": {"b": None}}, ("a", "b"))  # NaN


def test_markdown_table_prints_signed_percentages() -> None:
    rows = [MetricComparison("x", "median TTFT (ms)", 1000.0, 1100.0, 0.1, True, 0.15),
            MetricComparison("y", "P95 TPOT (ms)", 200.0, 190.0, -0.05, True, 0.15)]
    text = markdown_table(rows)
    assert "| median TTFT (ms) | 1,000.0 | 1,100.0 | +10.0% |" in text
    assert "| P95 TPOT (ms) | 200.0 | 190.0 | -5.0% |" in text


# ---------------------------------------------------------------- calibration model and fit
QWEN = load_model_spec("qwen2.5-0.5b")
TRUE = Calibration(bandwidth=12e9, flop_rate=80e9, attn_flop_rate=20e9, gather_rate=2e9, overhead_s=0.004,
                   per_seq_overhead_s=0.0003, overlap="sum", dispatch_s=0.005)


def _samples(cal: Calibration, shapes, feats) -> list:
    """(entries, period, forward) as the engine would report them if `cal` were the truth."""
    periods = _predict(cal, feats, shapes)
    return [(e, t, t - cal.overhead_s - cal.per_seq_overhead_s * len(e)) for e, t in zip(shapes, periods)]


def _shapes() -> list[list[tuple[int, int, bool]]]:
    shapes = []
    for b in (1, 2, 4, 8, 16, 32):
        shapes.append([(1, 30 + 5 * i, True) for i in range(b)])
        shapes.append([(1, 600 + i, True) for i in range(b)])
        shapes.append([(8, 592, True) for i in range(b)])
    for n in (8, 32, 96, 256, 512):
        shapes.append([(n, 0, True)])
        shapes.append([(n, 512, False)])
    shapes.append([(1, 100, True)] * 6 + [(200, 0, True), (60, 300, False)])
    return shapes


@pytest.mark.parametrize("overlap", ["sum", "max"])
def test_fit_recovers_the_parameters_that_made_the_steps(overlap: str) -> None:
    import dataclasses

    truth = dataclasses.replace(TRUE, overlap=overlap)
    feats = StepFeatures(QWEN, "float32")
    shapes = _shapes()
    cal = fit(_samples(truth, shapes, feats), feats, bandwidth_ref=10e9, flop_rate_ref=100e9,
              dispatch_s=truth.dispatch_s)
    assert cal.overlap == overlap and cal.other_overlap_error > 0.01  # the data tell the two apart
    assert cal.bandwidth == pytest.approx(truth.bandwidth, rel=0.03)
    assert cal.flop_rate == pytest.approx(truth.flop_rate, rel=0.03)
    assert cal.overhead_s == pytest.approx(truth.overhead_s, rel=1e-6)
    assert cal.per_seq_overhead_s == pytest.approx(truth.per_seq_overhead_s, rel=1e-6)
    assert cal.max_abs_rel_error < 0.03 and cal.num_steps == len(shapes) and cal.num_dropped == 0
    assert cal.mem_efficiency == pytest.approx(1.2, rel=0.03)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_fit_recovers_a_row_dependent_gemm_rate() -> None:
    """GEMMs over few rows run below the rate over many: F(r) = F * r / (r + r_half)."""
    truth = dataclasses.replace(TRUE, overlap="max", gemm_half_rows=8.0)
    feats = StepFeatures(QWEN, "float32")
    cal = fit(_samples(truth, _shapes(), feats), feats, bandwidth_ref=10e9, flop_rate_ref=100e9,
              dispatch_s=truth.dispatch_s)
    assert cal.gemm_half_rows == 8.0 and cal.overlap == "max"
    assert cal.flop_rate == pytest.approx(truth.flop_rate, rel=0.03)
    assert cal.bandwidth == pytest.approx(truth.bandwidth, rel=0.03)
    # fitted with one rate for every shape, the same steps are explained worse
    one = fit(_samples(truth, _shapes(), feats), feats, bandwidth_ref=10e9, flop_rate_ref=100e9,
              dispatch_s=truth.dispatch_s, half_rows=(0.0,))
    assert one.median_abs_rel_error > 3 * max(cal.median_abs_rel_error, 1e-3)


def test_fit_drops_steps_disturbed_by_other_processes() -> None:
    feats = StepFeatures(QWEN, "float32")
    samples = _samples(TRUE, _shapes(), feats)
    for i in (3, 10, 17):  # another process stole the cores during these steps
        e, t, f = samples[i]
        samples[i] = (e, t + 1.5 * f, 2.5 * f)
    cal = fit(samples, feats, bandwidth_ref=10e9, flop_rate_ref=100e9, dispatch_s=TRUE.dispatch_s)
    shapes = _shapes()
    assert cal.num_dropped == 3 and cal.num_steps == len(shapes) - 3
    assert cal.flop_rate == pytest.approx(TRUE.flop_rate, rel=0.03)
    assert cal.bandwidth == pytest.approx(TRUE.bandwidth, rel=0.03)


def test_in_place_decode_attention_costs_the_actual_context_not_the_padded_group() -> None:
    """With the paged decode kernel a request's attention reads its own context; the gather
    path pads every decode in the step to the longest block table and copies it."""
    padded, in_place = StepFeatures(QWEN, "float32"), StepFeatures(QWEN, "float32", paged_decode=True)
    step = [(1, 999, True), (1, 9, True), (1, 9, True)]  # one long context, two short ones
    kv = QWEN.kv_bytes_per_token("float32")
    assert in_place.parts(step).gather_bytes == (1000 + 10 + 10) * kv
    assert padded.parts(step).gather_bytes == 3 * 1008 * kv  # rounded up to whole 16-token blocks
    assert in_place.parts(step).attn_flops == 1020 * QWEN.attention_flops_per_position
    prefill = [(64, 0, True)]  # prefill chunks keep the padded path either way
    assert in_place.parts(prefill) == padded.parts(prefill)
    cal = dataclasses.replace(TRUE, paged_decode=True)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))).paged_decode


def test_engine_cost_model_charges_the_logits_matmul_only_when_sampling() -> None:
    cm = EngineCostModel(QWEN, get_hardware("rtx4090"), "float32", TRUE)
    feats = StepFeatures(QWEN, "float32")
    with_head = cm.entries_cost([(256, 0, True)]).time_s
    without = cm.entries_cost([(256, 0, False)]).time_s
    head_bytes = QWEN.logits_matmul_params * 4
    # TRUE says memory and compute do not overlap: the head costs its read plus its FLOPs.
    assert with_head - without == pytest.approx(head_bytes / TRUE.bandwidth + 2 * QWEN.logits_matmul_params / TRUE.flop_rate)
    assert head_bytes == feats.head_bytes
    # The parent's interface assumes every entry samples; decode steps grow with the batch.
    assert cm.step_time([(256, 0)], []) == pytest.approx(with_head)
    assert cm.decode_cost(8, 100).time_s > cm.decode_cost(1, 100).time_s > TRUE.overhead_s
    assert cm.step_time([], []) == 0.0


# ---------------------------------------------------------------- simulator vs the real engine
class UnitCost(CostModel):
    """Every step takes exactly one second: step k runs over [k, k+1] on the virtual clock."""

    def step_time(self, prefill, decode_context_lens) -> float:
        return 1.0


def _shape(events, prefix: str) -> list[tuple]:
    out = []
    for ev in events:
        entries = tuple((int(e.request_id[len(prefix):]), e.phase, e.num_tokens, e.kv_len_before,
                         e.sampled_token_id is not None, e.finished) for e in ev.entries)
        preempted = tuple(int(r[len(prefix):]) for r in ev.preempted)
        out.append((entries, preempted, ev.num_waiting))
    return out


@pytest.mark.parametrize("chunked", [True, False])
def test_simulator_batches_exactly_like_the_engine(model_factory, chunked: bool) -> None:
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    model = model_factory("tiny-llama")
    # 26 blocks of 4 tokens hold ~100 tokens of KV: three requests of up to 67 tokens must preempt.
    limits = dict(max_num_seqs=3, max_num_batched_tokens=24 if chunked else 96, block_size=4, num_kv_blocks=26,
                  max_model_len=96, enable_chunked_prefill=chunked, enable_prefix_caching=True)
    wl = generate_workload(WorkloadSpec(name="random", num_prompts=7, input_len=(6, 45), output_len=(12, 40),
                                        vocab_range=(5, 1000), seed=3))
    shared = wl[0].prompt_token_ids[:8]  # two requests share a 2-block prefix: prefix-cache hits in both runs
    wl[4] = BenchRequest(shared + wl[4].prompt_token_ids[8:], wl[4].output_len)
    arrive_at_step = [0, 0, 1, 2, 2, 5, 6]

    # Real engine: request i joins just before step arrive_at_step[i].
    llm = LLM(str(model), **limits)
    eng = llm.llm_engine
    real_events: list = []
    eng.add_observer(real_events.append)
    step = nxt = 0
    while nxt < len(wl) or eng.has_unfinished_requests():
        while nxt < len(wl) and arrive_at_step[nxt] <= step:
            r = wl[nxt]
            eng.add_request(f"r{nxt}", {"prompt_token_ids": r.prompt_token_ids},
                            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0))
            nxt += 1
        assert eng.has_unfinished_requests(), "the workload must keep the engine busy (no idle jumps)"
        eng.step()
        step += 1

    # Simulator: one second per step, so arriving at k - 0.5 s means joining just before step k.
    spec = load_model_spec(str(model))
    cm = UnitCost(spec, get_hardware("rtx4090"), "float32")
    reqs = [BenchRequest(r.prompt_token_ids, r.output_len, max(0.0, k - 0.5)) for r, k in zip(wl, arrive_at_step)]
    sim_events: list = []
    res = Simulator(cm, SimConfig(**limits), observers=[sim_events.append]).run(reqs)

    real, sim = _shape(real_events, "r"), _shape(sim_events, "sim-")
    assert len(real) == len(sim)
    for k, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"step {k}: engine {a} vs simulator {b}"
    # The run exercised what makes the comparison meaningful.
    phases = {e[1] for entries, _, _ in real for e in entries}
    assert "decode" in phases and ("prefill_chunk" in phases) == chunked
    assert any(p for _, p, _ in real), "expected KV pressure to preempt someone"
    assert max(len(entries) for entries, _, _ in real) == 3
    assert res.prefix_cache_hit_rate > 0
    assert [r.output_len for r in res.records] == [r.output_len for r in wl]


# ---------------------------------------------------------------- client concurrency in the simulator
def test_simulator_max_concurrency_holds_requests_back() -> None:
    spec = load_model_spec("qwen2.5-0.5b")
    cm = UnitCost(spec, get_hardware("rtx4090"), "float16")
    cfg = SimConfig(max_model_len=256, num_kv_blocks=64)
    reqs = [BenchRequest(list(range(5, 15)), 3, 0.0) for _ in range(3)]
    res = Simulator(cm, cfg).run(reqs, max_concurrency=1, client_turnaround_s=0.0)
    a, b, c = res.records
    # One at a time: prefill + 2 decodes = 3 steps each.
    assert (a.first_token_time, a.end_time) == (1.0, 3.0)
    assert b.send_time == 3.0 and (b.first_token_time, b.end_time) == (4.0, 6.0)
    assert c.send_time == 6.0 and c.end_time == 9.0
    assert res.steps.num_seqs == [1] * 9
    free = Simulator(cm, cfg).run(reqs)
    assert free.steps.num_seqs == [3, 3, 3] and all(r.send_time is None for r in free.records)


def test_a_closed_loop_client_misses_the_step_that_starts_as_its_slot_frees() -> None:
    """The next request of a `--max-concurrency` client reaches the engine a moment after the
    step that finished its predecessor ended; the engine has begun its next step by then."""
    from tokenloom.sim.fleet import FleetSimulator

    spec = load_model_spec("qwen2.5-0.5b")
    cm = UnitCost(spec, get_hardware("rtx4090"), "float16")
    cfg = SimConfig(max_model_len=256, num_kv_blocks=64)
    reqs = [BenchRequest(list(range(5, 15)), 6, 0.0), BenchRequest(list(range(20, 30)), 2, 0.0),
            BenchRequest(list(range(40, 50)), 2, 0.0)]
    for sim in (Simulator(cm, cfg), FleetSimulator(cm, cfg, num_replicas=1)):
        late = sim.run(reqs, max_concurrency=2).records[2]  # the second finishes at t=2; A keeps stepping
        assert late.send_time == pytest.approx(2.002) and late.first_token_time == pytest.approx(4.0)
        now = sim.run(reqs, max_concurrency=2, client_turnaround_s=0.0).records[2]
        assert now.send_time == 2.0 and now.first_token_time == 3.0


# ---------------------------------------------------------------- `simulate --compare-with`, end to end
def _fake_local_caches(tmp_path, monkeypatch, model_dir: str) -> Calibration:
    """Pre-seed the microbench and calibration caches so no measurement runs."""
    from tokenloom.specs import microbench

    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    key = microbench.cache_key()
    mb = {"key": key, "device_name": "test cpu", "memory_bytes": 2**34, "mem_bandwidth": 10e9,
          "matmul_flops": {"float16": 1e10, "bfloat16": 1e10, "float32": 5e10}, "op_overhead_s": 1e-5}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "microbench.json").write_text(json.dumps({"version": microbench._CACHE_VERSION, "entries": {key: mb}}))
    spec = load_model_spec(model_dir)
    cal = Calibration(bandwidth=5e9, flop_rate=2e10, attn_flop_rate=1e10, gather_rate=1e9, overhead_s=0.002,
                      per_seq_overhead_s=1e-4, microbench_bandwidth=10e9, microbench_flop_rate=5e10)
    entries = {calibration_key(spec, "float32", 16, mode): cal.to_dict() for mode in ("serve", "offline")}
    (tmp_path / "cache" / "calibration.json").write_text(json.dumps({"version": 1, "entries": entries}))
    return cal


def _bench_doc(model_dir: str, summary: dict, groups: dict | None = None) -> dict:
    spec = WorkloadSpec(name="mixed-long", num_prompts=12, input_len=(8, 40), output_len=(4, 12), seed=2,
                        vocab_range=(5, 1000), request_rate=50.0, long_fraction=0.25, long_len=120,
                        max_model_len=256)
    reqs = generate_workload(spec)
    return {"benchmark": "serve",
            "config": {"launch": model_dir, "dtype": "auto", "max_num_seqs": 4, "max_num_batched_tokens": 64,
                       "max_model_len": 256, "block_size": 16, "num_kv_blocks": 64, "kv_cache_memory": None,
                       "enable_chunked_prefill": True, "enable_prefix_caching": True, "scheduling_policy": "fcfs",
                       "max_concurrency": None, "load_workload": None},
            "workload": {"spec": spec.to_dict(), "stats": workload_stats(reqs)},
            "results": {"summary": summary, "groups": groups or {}}}


def test_compare_with_end_to_end(model_factory, tmp_path, monkeypatch, capsys) -> None:
    from tokenloom.entrypoints.cli import main

    model = str(model_factory("tiny-llama"))
    _fake_local_caches(tmp_path, monkeypatch, model)
    # First pass: dummy "measurements" 10% below... whatever the simulator says.
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_doc(model, _summary(1.0, 1.0, 1.0, 1.0))))
    out = tmp_path / "validation.json"
    rc = main(["simulate", "--compare-with", str(path), "--output-json", str(out)])
    assert rc == 1  # made-up measurements cannot match
    doc = json.loads(out.read_text())
    sim_summary, sim_groups = doc["simulated"]["summary"], doc["simulated"]["groups"]
    assert doc["workload"] == "mixed-long" and doc["num_requests"] == 12 and doc["sim_config"]["num_kv_blocks"] == 64
    assert set(sim_groups) == {"short", "long"}

    # Second pass: the "measurements" are the simulation itself, scaled by 1.1 -> every error is -1/11.
    scaled = json.loads(json.dumps(sim_summary))
    for k in ("ttft_ms", "tpot_ms"):
        for q in ("median", "p95"):
            scaled[k][q] *= 1.1
    scaled["output_throughput"] *= 1.1
    path.write_text(json.dumps(_bench_doc(model, scaled, sim_groups)))
    capsys.readouterr()
    rc = main(["simulate", "--compare-with", str(path), "--output-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    errs = {r["key"]: r["rel_error"] for r in doc["comparison"]}
    for k in ("ttft_median", "tpot_median", "tpot_p95", "output_throughput"):
        assert errs[k] == pytest.approx(-1 / 11)
    assert doc["within_tolerance"] and doc["groups"]["long"][0]["rel_error"] == pytest.approx(0.0)
    assert "-9.1%" in text and "4/4 headline figures within 15%" in text and "group 'long'" in text
    assert doc["calibration"]["bandwidth"] == 5e9


def test_rebuilt_workload_must_match_the_recorded_one(tmp_path) -> None:
    doc = _bench_doc("/nonexistent", {})
    assert len(rebuild_requests(doc)) == 12
    doc["workload"]["stats"]["total_input_tokens"] += 1
    with pytest.raises(ValueError, match="differs from the measured one"):
        rebuild_requests(doc)


def test_compare_with_a_sweep_simulates_every_point(model_factory, tmp_path, monkeypatch, capsys) -> None:
    from tokenloom.entrypoints.cli import main

    model = str(model_factory("tiny-llama"))
    _fake_local_caches(tmp_path, monkeypatch, model)
    doc = _bench_doc(model, {})
    doc["benchmark"] = "sweep"
    doc["config"] = {**doc["config"], "model": model, "mode": "offline", "max_concurrency": 3}
    row = {"output_throughput": 100.0, "ttft_p50_ms": 50.0, "ttft_p95_ms": 90.0, "tpot_p50_ms": 10.0,
           "tpot_p95_ms": 20.0}
    doc["results"] = {"points": [
        {"max_num_seqs": 2, "max_num_batched_tokens": 32, "chunked_prefill": True, **row},
        {"max_num_seqs": 4, "max_num_batched_tokens": 128, "chunked_prefill": True, **row},
        {"max_num_seqs": 4, "max_num_batched_tokens": 16, "chunked_prefill": False, "error": "invalid"}]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "v.json"
    rc = main(["simulate", "--compare-with", str(path), "--output-json", str(out)])
    text = capsys.readouterr().out
    assert rc in (0, 1) and "bench sweep: measured / simulated" in text
    v = json.loads(out.read_text())
    assert [p["point"]["max_num_seqs"] for p in v["points"]] == [2, 4]  # the failed point is skipped
    first = {r["key"]: r for r in v["points"][0]["comparison"]}
    assert first["tpot_p95"]["measured"] == 20.0 and first["ttft_p95"]["measured"] == 90.0
    assert first["output_throughput"]["rel_error"] == pytest.approx(first["output_throughput"]["simulated"] / 100.0 - 1)
    # Different limits, different simulated runs.
    second = {r["key"]: r for r in v["points"][1]["comparison"]}
    assert first["ttft_median"]["simulated"] != second["ttft_median"]["simulated"]


def test_calibration_plan_covers_the_shapes_serving_needs() -> None:
    from tokenloom.sim.calibration_plan import calibration_plan, decode_step_s, samples_from

    plan = calibration_plan((5, 1000), max_model_len=1024)
    names = [n for n, _ in plan]
    assert names[0] == "decode batch 8"  # the first item sets the arrival unit
    assert all(len(p) + o <= 1024 for _, items in plan for p, o, _ in items)
    staggered = [n for n, items in plan if any(a > 0 for _, _, a in items)]
    assert len(staggered) == 2 and all("arriving" in n for n in staggered)
    assert calibration_plan((5, 1000), 1024) == plan  # seeded
    # Two runs of (entries, start, end, forward): periods get the median gap between steps.
    runs = [[([(1, 5, True)], 0.0, 1.0, 0.9), ([(1, 6, True)], 1.1, 2.0, 0.8)],
            [([(4, 0, True)], 5.0, 6.0, 0.95), ([(1, 4, True)], 6.3, 7.0, 0.6)]]
    samples, gap = samples_from(runs)
    assert gap == pytest.approx(0.2) and [round(t, 6) for _, t, _ in samples] == [1.2, 1.1, 1.2, 0.9]
    assert decode_step_s(runs[0]) == pytest.approx(0.95) and decode_step_s(runs[1][:1]) == 0.1


def test_the_simulator_measures_only_through_the_run_it_is_handed(model_factory, tmp_path, monkeypatch) -> None:
    """The run on the real engine stands above the simulator: `sim.calibrate` gets it from the
    command.  With nothing cached and no run handed in, it says so instead of measuring; the
    `tokenloom` command hands every subcommand the real run (`entrypoints.calibration_run`)."""
    from tokenloom.entrypoints.cli import build_parser
    from tokenloom.sim.calibrate import calibrate

    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "empty-cache"))
    model = str(model_factory("tiny-llama"))
    with pytest.raises(ValueError, match="no calibration .* is cached"):
        calibrate(model, "float32")
    args = build_parser().parse_args(["simulate", "--model", model, "--hardware", "local", "--calibrated"])
    with pytest.raises(ValueError, match="calibration mode must be one of"):  # the real run's own check
        args.measure_engine(model, "float32", mode="no-such-mode")


def test_the_calibration_server_runs_as_its_module() -> None:
    """The calibration starts its server as `python -m tokenloom.entrypoints.calibration_run`:
    the module is runnable there and checks its command line."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.calibration_run"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode != 0
    assert "usage: python -m tokenloom.entrypoints.calibration_run --steps-out FILE -- serve MODEL" in run.stderr


def test_a_base_url_benchmark_cannot_be_replayed(tmp_path) -> None:
    from tokenloom.sim.validate import inputs_from_bench

    doc = _bench_doc("/nonexistent", {})
    doc["config"]["launch"] = None
    with pytest.raises(ValueError, match="--base-url"):
        inputs_from_bench(doc)


def test_compare_with_a_data_parallel_run_replays_the_fleet(model_factory, tmp_path, monkeypatch) -> None:
    """`bench serve --data-parallel-size 2 --num-threads 1` is replayed as two simulated replicas
    behind the cache-aware router, each with one replica's share of the machine, timed by the
    calibration taken with a busy neighbor (its own cache key)."""
    from tokenloom.sim import validate as validate_mod

    model = str(model_factory("tiny-llama"))
    cal = _fake_local_caches(tmp_path, monkeypatch, model)
    spec = load_model_spec(model)
    key = calibration_key(spec, "float32", 16, "serve", num_threads=1, replicas=2)
    assert key != calibration_key(spec, "float32", 16, "serve")  # a fleet's replica steps slower: its own fit
    slow = dataclasses.replace(cal, overhead_s=cal.overhead_s * 5)
    cache = tmp_path / "cache" / "calibration.json"
    doc_cache = json.loads(cache.read_text())
    doc_cache["entries"][key] = slow.to_dict()
    cache.write_text(json.dumps(doc_cache))

    doc = _bench_doc(model, _summary(1.0, 1.0, 1.0, 1.0))
    doc["config"].update(data_parallel_size=2, num_threads=1, num_kv_blocks=None)
    path = tmp_path / "dp2.json"
    path.write_text(json.dumps(doc))
    v = validate_mod.validate(path)
    assert v.inputs.data_parallel_size == 2 and v.inputs.engine_threads == 1
    assert v.calibration.overhead_s == pytest.approx(slow.overhead_s)  # the neighbors' calibration was used
    # With no threads or KV size given, each replica gets its share, as `serve -dp` gives it.
    import os

    from tokenloom.config import default_kv_cache_bytes

    share = validate_mod.replica_flags({**doc["config"], "num_threads": None}, 2)
    assert share == {"num_threads": max(1, len(os.sched_getaffinity(0)) // 2),
                     "kv_cache_memory": str(default_kv_cache_bytes("cpu") // 2)}
    # Two replicas serve the same requests in less simulated time than one engine with the same costs.
    from tokenloom.sim.fleet import FleetSimulator
    from tokenloom.specs.hardware import local_hardware

    cm = EngineCostModel(spec, local_hardware(), "float32", slow)
    fleet = FleetSimulator(cm, v.inputs.sim_config, num_replicas=2, router="cache-aware").run(v.inputs.requests)
    single = FleetSimulator(cm, v.inputs.sim_config, num_replicas=1).run(v.inputs.requests)
    assert v.sim_summary["duration_s"] == pytest.approx(fleet.duration_s)
    assert fleet.duration_s < single.duration_s
