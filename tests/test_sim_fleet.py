"""The simulator sizes a fleet: N simulated replicas behind the router's own policy classes.

One replica must be the single-engine simulator exactly; two must cut queueing under a rate
one cannot keep up with; cache-aware routing must keep a shared-prefix group on one replica
(so the fleet's prefix-cache hit rate is the single engine's) where round-robin spreads it.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tokenloom.measure.metrics import summarize
from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, generate_workload
from tokenloom.entrypoints.cli import main
from tokenloom.router.policy import POLICIES
from tokenloom.sim.estimate import CostModel
from tokenloom.sim.fleet import FleetSimulator, simulate_fleet
from tokenloom.sim.simulator import SimConfig, Simulator
from tokenloom.specs.hardware import get_hardware
from tokenloom.specs.model_spec import load_model_spec

CFG = SimConfig(max_model_len=2048, kv_cache_memory="256MiB", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return CostModel(load_model_spec("qwen2.5-0.5b"), get_hardware("rtx4090"), "float16")


def _workload(name: str, n: int, rate: float, **kw) -> list[BenchRequest]:
    return generate_workload(WorkloadSpec(name=name, num_prompts=n, request_rate=rate, vocab_range=(5, 151936),
                                          **{"input_len": (32, 256), "output_len": (8, 96), **kw}))


def _p95_ttft(res) -> float:
    return summarize(res.records, duration=res.duration_s).ttft_ms.p(95)


@pytest.mark.parametrize("case", ["prefix", "concurrency", "preemption", "refused"])
def test_one_replica_is_the_simulator_exactly(cm: CostModel, case: str) -> None:
    cfg, mc = CFG, None
    reqs = _workload("prefix", 120, 150.0, num_prefix_groups=3, prefix_len=128)
    if case == "concurrency":
        reqs, mc = _workload("random", 80, float("inf")), 8
    elif case == "preemption":
        cfg = SimConfig(max_model_len=512, num_kv_blocks=40, max_num_batched_tokens=256)
        reqs = _workload("random", 40, float("inf"), input_len=(64, 200), output_len=(64, 128))
    elif case == "refused":
        cfg = SimConfig(max_model_len=200, num_kv_blocks=400)
        reqs = _workload("random", 30, 50.0, input_len=(16, 180))
    single = Simulator(cm, cfg).run(reqs, seed=7, max_concurrency=mc)
    for router in POLICIES:
        fleet = FleetSimulator(cm, cfg, num_replicas=1, router=router).run(reqs, seed=7, max_concurrency=mc)
        assert [r.to_dict() for r in fleet.records] == [r.to_dict() for r in single.records]
        assert fleet.duration_s == single.duration_s
        assert fleet.steps.summary() == single.steps.summary()
        assert fleet.num_preemptions == single.num_preemptions
        assert fleet.prefix_cache_hit_rate == pytest.approx(single.prefix_cache_hit_rate, nan_ok=True)
    if case == "preemption":
        assert single.num_preemptions > 0
    if case == "refused":
        assert any(not r.success for r in single.records) and any(r.success for r in single.records)
        assert [k is None for k in fleet.replica_of] == [not r.success for r in single.records]


def test_two_replicas_cut_queueing_under_a_saturating_rate(cm: CostModel) -> None:
    reqs = _workload("random", 300, 700.0)
    one = simulate_fleet(reqs, cm, CFG, num_replicas=1, seed=1)
    s1 = summarize(one.records, duration=one.duration_s)
    # The rate is more than one replica serves: its queue (hence TTFT) grows through the run.
    assert s1.completed == 300 and s1.request_throughput < 700.0 * 0.8
    for router in POLICIES:
        two = simulate_fleet(reqs, cm, CFG, num_replicas=2, router=router, seed=1)
        s2 = summarize(two.records, duration=two.duration_s)
        assert s2.completed == 300 and s2.failed == 0  # every request completes
        assert all(r.success and r.output_len == r.expected_output_len for r in two.records)
        assert sum(r.num_requests for r in two.replicas) == 300
        assert all(r.num_requests > 100 for r in two.replicas), router  # both replicas work
        assert set(two.replica_of) == {0, 1}
        assert s2.ttft_ms.p(95) < s1.ttft_ms.p(95) / 2, router
        assert two.duration_s < one.duration_s


def test_cache_aware_keeps_a_prefix_group_on_one_replica(cm: CostModel) -> None:
    reqs = _workload("prefix", 120, 20.0, num_prefix_groups=4, prefix_len=256, input_len=(16, 64))
    single = simulate_fleet(reqs, cm, CFG, num_replicas=1, seed=2)
    aware = simulate_fleet(reqs, cm, CFG, num_replicas=2, router="cache-aware", seed=2)
    rr = simulate_fleet(reqs, cm, CFG, num_replicas=2, router="round-robin", seed=2)
    where: dict[str, set[int]] = defaultdict(set)
    for r, k in zip(reqs, aware.replica_of):
        where[r.group].add(k)
    assert all(len(ks) == 1 for ks in where.values()), dict(where)  # each group stays on one replica
    assert {k for ks in where.values() for k in ks} == {0, 1}  # and the groups are spread
    assert single.prefix_cache_hit_rate > 0.5
    assert aware.prefix_cache_hit_rate == pytest.approx(single.prefix_cache_hit_rate)
    assert rr.prefix_cache_hit_rate < single.prefix_cache_hit_rate
    for res in (aware, rr):
        assert all(r.success for r in res.records)


def test_more_replicas_never_lose_a_request(cm: CostModel) -> None:
    reqs = _workload("mixed-long", 200, float("inf"), long_len=1024)
    for n in (3, 4):
        res = simulate_fleet(reqs, cm, CFG, num_replicas=n, router="least-loaded", seed=0)
        assert all(r.success and r.output_len == r.expected_output_len for r in res.records)
        assert all(k is not None for k in res.replica_of)  # every request placed
        assert {r.num_requests for r in res.replicas} == {200 // n} | ({200 // n + 1} if 200 % n else set())


def test_bad_fleet_arguments_are_refused(cm: CostModel) -> None:
    with pytest.raises(ValueError, match="replicas"):
        FleetSimulator(cm, CFG, num_replicas=0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        FleetSimulator(cm, CFG, num_replicas=2, router="random")


_CLI = ["simulate", "--hardware", "rtx4090", "--model", "qwen2.5-0.5b", "--workload", "prefix", "--num-prompts", "60",
        "--num-prefix-groups", "3", "--prefix-len", "128", "--input-len", "16:64", "--output-len", "8:32",
        "--request-rate", "40", "--max-model-len", "2048", "--kv-cache-memory", "256MiB"]


def test_cli_replicas_and_router(tmp_path, capsys) -> None:
    out = tmp_path / "fleet.json"
    rc = main([*_CLI, "--replicas", "2", "--router", "round-robin", "--show-steps", "2", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 replicas, router round-robin" in text and "Replicas (router round-robin)" in text
    assert "r0 step    1" in text and "TTFT" in text
    doc = json.loads(out.read_text())
    assert doc["results"]["router"] == "round-robin"
    assert [r["num_requests"] for r in doc["results"]["replicas"]] == [30, 30]
    assert doc["results"]["summary"]["completed"] == 60
    assert sorted({d["replica"] for d in doc["requests"]}) == [0, 1]


def test_cli_one_replica_prints_what_it_did_before(tmp_path, capsys) -> None:
    docs, texts = [], []
    for extra in ([], ["--replicas", "1", "--router", "round-robin"]):
        out = tmp_path / f"one{len(docs)}.json"
        assert main([*_CLI, *extra, "--output-json", str(out)]) == 0
        texts.append([ln for ln in capsys.readouterr().out.splitlines() if "wall_s" not in ln and "wrote" not in ln])
        docs.append(json.loads(out.read_text()))
    assert texts[0] == texts[1]
    assert "Replicas" not in "\n".join(texts[0])
    assert docs[0]["results"] == docs[1]["results"] | {"steps": {**docs[1]["results"]["steps"],
                                                                 "wall_s": docs[0]["results"]["steps"]["wall_s"]}}
    assert docs[0]["requests"] == docs[1]["requests"]
