"""Benchmark workloads: reproducible for a seed, honoring ranges and the arrival process."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from tokenloom.measure.workloads import (
    WORKLOADS,
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    arrival_times,
    generate_workload,
    load_jsonl,
    parse_range,
    save_jsonl,
    vocab_range_for,
    workload_from_args,
    workload_stats,
)


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_other_seed_differs(name):
    spec = WorkloadSpec(name=name, num_prompts=30, input_len=(8, 40), output_len=(2, 9),
                        vocab_range=(5, 500), long_len=100, prefix_len=16, request_rate=5.0, seed=3)
    a, b = generate_workload(spec), generate_workload(spec)
    assert a == b
    c = generate_workload(WorkloadSpec(**{**spec.__dict__, "seed": 4}))
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


@pytest.mark.parametrize("name", ["random", "sharegpt-like"])
def test_lengths_and_token_ids_stay_in_range(name):
    spec = WorkloadSpec(name=name, num_prompts=500, input_len=(10, 60), output_len=(3, 17), vocab_range=(5, 100))
    reqs = generate_workload(spec)
    assert len(reqs) == 500
    for r in reqs:
        assert 10 <= r.prompt_len <= 60
        assert 3 <= r.output_len <= 17
        assert min(r.prompt_token_ids) >= 5 and max(r.prompt_token_ids) < 100
        assert r.arrival_time == 0.0 and r.group is None
    lens = [r.prompt_len for r in reqs]
    # Both ends of the range are reachable (uniform: by chance; log-normal: by clipping).
    assert min(lens) == 10 and max(lens) == 60


def test_sharegpt_like_is_long_tailed():
    reqs = generate_workload(WorkloadSpec(name="sharegpt-like", num_prompts=4000, input_len=(16, 1024)))
    lens = np.array([r.prompt_len for r in reqs])
    assert np.mean(lens) > 1.5 * np.median(lens)  # mean pulled up by the tail
    assert np.median(lens) < 200


def test_mixed_long_has_the_requested_share_of_long_prompts():
    spec = WorkloadSpec(name="mixed-long", num_prompts=50, input_len=(10, 30), output_len=(4, 4),
                        long_fraction=0.2, long_len=300, vocab_range=(5, 1000))
    reqs = generate_workload(spec)
    longs = [r for r in reqs if r.group == "long"]
    shorts = [r for r in reqs if r.group == "short"]
    assert len(longs) == 10 and len(shorts) == 40
    assert all(r.prompt_len == 300 for r in longs)
    assert all(10 <= r.prompt_len <= 30 for r in shorts)


def test_prefix_groups_share_their_prefix_and_not_their_suffix():
    spec = WorkloadSpec(name="prefix", num_prompts=24, num_prefix_groups=3, prefix_len=32,
                        input_len=(5, 10), vocab_range=(5, 50000))
    reqs = generate_workload(spec)
    by_group: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == ["prefix-0", "prefix-1", "prefix-2"]
    prefixes = set()
    for rs in by_group.values():
        assert len(rs) == 8
        heads = {tuple(r.prompt_token_ids[:32]) for r in rs}
        assert len(heads) == 1
        prefixes |= heads
        suffixes = {tuple(r.prompt_token_ids[32:]) for r in rs}
        assert len(suffixes) == len(rs)
        assert all(37 <= r.prompt_len <= 42 for r in rs)
    assert len(prefixes) == 3


def test_infinite_rate_means_everything_at_zero():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_requested_mean_rate(burstiness):
    t = np.array(arrival_times(20001, request_rate=8.0, burstiness=burstiness, seed=1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    # Gamma(shape k): coefficient of variation 1/sqrt(k) -- lower burstiness, burstier arrivals.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_rate_does_not_change_the_prompts():
    base = dict(num_prompts=20, vocab_range=(5, 300), seed=7)
    a = generate_workload(WorkloadSpec(**base, request_rate=math.inf))
    b = generate_workload(WorkloadSpec(**base, request_rate=3.0))
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert any(r.arrival_time > 0 for r in b)


def test_max_model_len_keeps_prompt_plus_output_inside():
    spec = WorkloadSpec(name="mixed-long", num_prompts=20, long_len=500, long_fraction=0.5,
                        output_len=(50, 60), max_model_len=256)
    for r in generate_workload(spec):
        assert r.prompt_len + r.output_len <= 256


def test_invalid_specs_are_rejected_with_the_flag_name():
    with pytest.raises(ValueError, match="--input-len"):
        WorkloadSpec(input_len=(10, 5))
    with pytest.raises(ValueError, match="--workload"):
        WorkloadSpec(name="nope")
    with pytest.raises(ValueError, match="--request-rate"):
        WorkloadSpec(request_rate=0)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range("a:b")
    assert parse_range("7") == (7, 7) and parse_range("3:9") == (3, 9)


def test_argparse_round_trip_and_jsonl(tmp_path):
    parser = add_workload_args(argparse.ArgumentParser())
    out = tmp_path / "w.jsonl"
    args = parser.parse_args(["--workload", "prefix", "--num-prompts", "9", "--input-len", "4:6",
                              "--output-len", "3", "--request-rate", "2", "--burstiness", "0.5",
                              "--num-prefix-groups", "2", "--prefix-len", "8", "--seed", "11",
                              "--save-workload", str(out)])
    spec, reqs = workload_from_args(args, (5, 200))
    assert spec.name == "prefix" and spec.output_len == (3, 3) and spec.ignore_eos
    assert len(reqs) == 9 and all(r.output_len == 3 for r in reqs)
    assert load_jsonl(out) == reqs
    args2 = parser.parse_args(["--load-workload", str(out)])
    assert workload_from_args(args2, (5, 200))[1] == reqs
    stats = workload_stats(reqs)
    assert stats["num_requests"] == 9 and stats["total_output_tokens"] == 27
    assert sum(stats["groups"].values()) == 9
    assert spec.to_dict()["request_rate"] == 2.0
    assert parser.parse_args([]).request_rate == math.inf


def test_vocab_range_skips_special_ids():
    class Tok:
        vocab_size = 1000
        all_special_ids = [0, 1, 2, 5, 6, 999]

    assert vocab_range_for(Tok(), model_vocab_size=1024) == (7, 1000)
    assert vocab_range_for(None, model_vocab_size=64) == (5, 64)
    save_jsonl([], "/dev/null")
