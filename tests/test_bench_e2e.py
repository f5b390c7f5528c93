"""The benchmark commands, end to end on a tiny random model: complete JSON, no speed claims.

Small on purpose (a few prompts, a few tokens): these check that every figure is produced
and recorded, not how fast anything is.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tokenloom.entrypoints.cli import main as tokenloom_main

# Keep the engine small: a little KV cache, short contexts.
ENGINE = ["--kv-cache-memory", "16MiB", "--max-model-len", "256"]
WORKLOAD = ["--num-prompts", "4", "--input-len", "8:16", "--output-len", "2:4", "--seed", "1"]


def _machine_ok(doc: dict) -> None:
    m = doc["machine"]
    assert m["cpu_model"] and m["torch"] and m["torch_threads"] >= 1 and m["platform"]
    if Path("/proc/cpuinfo").exists():  # which microarchitecture: the family and model numbers, as cpuinfo has them
        text = Path("/proc/cpuinfo").read_text()
        assert f"cpu family\t: {m['cpu']['cpu family']}\n" in text and f"model\t\t: {m['cpu']['model']}\n" in text
        assert set(m["cpu"]["kernel_flags"].split()) <= set(text.split("flags\t\t:", 1)[1].split("\n", 1)[0].split())


def test_bench_throughput_with_hf_baseline(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    rc = tokenloom_main(["bench", "throughput", "--model", str(tiny_llama), *ENGINE, *WORKLOAD,
                         "--baseline", "hf", "--baseline-batch-size", "2", "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "throughput"
    _machine_ok(doc)
    assert doc["config"]["baseline"] == "hf" and doc["config"]["resolved"]["dtype"] == "torch.float32"
    stats = doc["workload"]["stats"]
    assert doc["workload"]["spec"]["name"] == "random" and stats["num_requests"] == 4
    res = doc["results"]
    engine, hf = res["engine"], res["hf"]
    # ignore_eos: both produce exactly the requested tokens.
    assert engine["total_output_tokens"] == stats["total_output_tokens"] == hf["total_output_tokens"]
    for d in (engine, hf):
        assert d["output_throughput"] > 0 and d["request_throughput"] > 0 and d["total_token_throughput"] > 0
        assert d["peak_rss_gib"] > 0
    # the memory the engine needs by design, and peak RSS measured against it
    assert 0 < engine["weights_gib"] < engine["peak_rss_gib"] and engine["kv_pool_gib"] > 0
    assert engine["peak_rss_over_weights_kv"] == pytest.approx(
        engine["peak_rss_gib"] / (engine["weights_gib"] + engine["kv_pool_gib"]))
    assert hf["num_batches"] == 2 and hf["generated_tokens"] >= hf["total_output_tokens"]
    assert res["speedup"]["output_throughput"] > 0
    assert engine["steps"]["num_steps"] > 0 and engine["steps"]["mean_batch_size"] > 0
    assert res["latency"]["ttft_ms"]["count"] == 4


def test_bench_serve_launches_a_server_and_records_every_request(tiny_llama, tmp_path):
    pytest.importorskip("tokenloom.entrypoints.cmd_serve", reason="the OpenAI server is not in this tree yet")
    out = tmp_path / "serve.json"
    rc = tokenloom_main(["bench", "serve", "--launch", str(tiny_llama), *ENGINE, *WORKLOAD,
                         "--workload", "mixed-long", "--long-len", "64", "--long-fraction", "0.25",
                         "--request-rate", "20", "--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000",
                         "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serve" and doc["server"]["launched"]
    _machine_ok(doc)
    assert "--kv-cache-memory" in doc["config"]["engine_flags"]
    s = doc["results"]["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["output_throughput"] > 0 and s["peak_concurrency"] <= 3
    assert s["good_requests"] == 4 and s["goodput_fraction"] == 1.0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert s[key]["count"] > 0 and s[key]["p95"] is not None
    assert set(doc["results"]["groups"]) == {"short", "long"}
    assert len(doc["requests"]) == 4
    for r in doc["requests"]:
        assert r["success"] and r["output_len"] == r["expected_output_len"]
        assert r["first_token_time"] >= r["send_time"] >= r["arrival_time"] - 1e-6
        assert len(r["token_times"]) >= 1


def test_bench_latency_roofline_and_sweep(tiny_llama, tmp_path):
    lat = tmp_path / "latency.json"
    assert tokenloom_main(["bench", "latency", "--model", str(tiny_llama), *ENGINE, "--batch-size", "2",
                           "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                           "--output-json", str(lat)]) == 0
    res = json.loads(lat.read_text())["results"]
    assert res["decode_step_ms"]["count"] > 0 and res["batch_latency_s"]["count"] == 1

    roof = tmp_path / "roofline.json"
    assert tokenloom_main(["bench", "roofline", "--model", str(tiny_llama), *ENGINE, "--batch-sizes", "1,2",
                           "--context-lens", "8,16", "--decode-steps", "2", "--bandwidth-mib", "16",
                           "--output-json", str(roof)]) == 0
    res = json.loads(roof.read_text())["results"]
    assert res["machine_roofline"]["bandwidth_gb_per_s"] > 0 and res["machine_roofline"]["matmul_gflop_per_s"] > 0
    assert {(p["batch"], p["context"]) for p in res["points"]} == {(1, 8), (2, 8), (1, 16), (2, 16)}
    for p in res["points"]:
        assert p["forward_ms"] > 0 and p["frac_mem_roof"] > 0 and p["frac_compute_roof"] > 0
        assert p["step_ms"] >= p["forward_ms"]
        # each point against the machine as measured around it: roof = bytes / that bandwidth
        assert p["roof_mem_ms"] == pytest.approx(p["mbytes_per_step"] / p["bandwidth_gb_per_s"])
        assert p["frac_step_at_roof"] == pytest.approx(max(p["roof_mem_ms"], p["roof_compute_ms"]) / p["step_ms"])
        # taken again (up to --max-tries 3) while the readings around it disagree by more than 10%
        assert 1 <= p["tries"] <= 3 and (p["machine_spread"] <= 0.10 or p["tries"] == 3)

    js, cs, png = tmp_path / "sweep.json", tmp_path / "sweep.csv", tmp_path / "sweep.png"
    assert tokenloom_main(["bench", "sweep", "--model", str(tiny_llama), *ENGINE, *WORKLOAD,
                           "--request-rate", "50", "--max-num-seqs-list", "2", "--max-num-batched-tokens-list",
                           "16,256", "--chunked-prefill", "both", "--disable-tqdm", "--output-json", str(js),
                           "--output-csv", str(cs), "--output-png", str(png)]) == 0
    points = json.loads(js.read_text())["results"]["points"]
    assert len(points) == 4
    # Without chunking a 16-token budget cannot hold a 256-token context: reported, not fatal.
    bad = [p for p in points if p["error"]]
    assert [(p["max_num_batched_tokens"], p["chunked_prefill"]) for p in bad] == [(16, False)]
    for p in points:
        if not p["error"]:
            assert p["completed"] == 4 and p["output_throughput"] > 0 and p["tpot_p95_ms"] is not None
    assert len(list(csv.DictReader(cs.open()))) == 4
    assert png.stat().st_size > 1000


def test_launcher_reports_a_server_that_dies(tmp_path):
    from tokenloom.bench.launcher import ServerStartError, free_port, start_server

    assert 0 < free_port() < 65536
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match="exited with code") as err:
        start_server(str(tmp_path / "no-such-model"), ["--no-such-flag"], log_path=log, timeout=120)
    assert "server log" in str(err.value) and log.exists()
