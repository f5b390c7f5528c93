"""Benchmark metrics on hand-made timelines: TTFT/TPOT/ITL, percentiles, goodput, concurrency."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenloom.measure.metrics import (
    RequestRecord,
    distribution,
    e2e_latency,
    itls,
    mean_concurrency,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    peak_concurrency,
    queue_delay,
    summarize,
    summarize_by_group,
    tpot,
    ttft,
)


def rec(start: float, token_times: list[float], prompt_len: int = 10, group: str | None = None,
        send: float | None = None, **kw) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, output_len=len(token_times), arrival_time=start,
                         send_time=send, first_token_time=token_times[0] if token_times else None,
                         token_times=list(token_times), end_time=token_times[-1] if token_times else None,
                         group=group, **kw)


def test_per_request_figures():
    r = rec(1.0, [1.5, 1.6, 1.8, 2.1])
    assert ttft(r) == pytest.approx(0.5)
    assert e2e_latency(r) == pytest.approx(1.1)
    assert tpot(r) == pytest.approx((1.1 - 0.5) / 3)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.3])
    assert queue_delay(r) == 0.0


def test_send_time_is_the_latency_origin_and_waiting_is_queue_delay():
    r = rec(0.0, [3.0, 4.0], send=2.0)
    assert ttft(r) == pytest.approx(1.0)
    assert queue_delay(r) == pytest.approx(2.0)


def test_one_token_output_has_no_tpot_and_failures_have_nothing():
    assert tpot(rec(0.0, [0.2])) is None
    bad = rec(0.0, [0.2, 0.3], success=False, error="boom")
    assert ttft(bad) is None and tpot(bad) is None and e2e_latency(bad) is None and itls(bad) == []


def test_distribution_uses_linear_percentiles():
    vals = list(range(1, 11))  # 1..10
    d = distribution(vals, (50, 90, 95, 99))
    assert d.count == 10 and d.mean == 5.5 and d.median == 5.5
    assert d.p(90) == pytest.approx(9.1)
    assert d.p(95) == pytest.approx(9.55)
    assert d.p(99) == pytest.approx(9.91)
    assert d.p(95) == pytest.approx(np.percentile(vals, 95))
    empty = distribution([], (95,))
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p(95))
    assert distribution([1.0, 2.0], (50,), scale=1000).median == 1500.0


def test_peak_concurrency():
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # touching intervals do not overlap
    assert peak_concurrency([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3
    assert peak_concurrency([(0, 5)] * 4) == 4
    assert mean_concurrency([(0, 2), (0, 1)]) == pytest.approx(1.5)


def test_goodput_parsing_and_slos():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    assert parse_goodput("e2el:2000") == {"e2el": 2.0}
    assert parse_goodput(None) == {}
    with pytest.raises(ValueError, match="KEY:MS"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="milliseconds"):
        parse_goodput(["ttft:fast"])
    fast = rec(0.0, [0.1, 0.15, 0.2])  # ttft 100ms, tpot 50ms
    slow_tpot = rec(0.0, [0.1, 0.3, 0.5])  # tpot 200ms
    assert meets_slos(fast, {"ttft": 0.1, "tpot": 0.05})
    assert not meets_slos(slow_tpot, {"ttft": 0.1, "tpot": 0.05})
    assert meets_slos(rec(0.0, [0.05]), {"tpot": 0.001})  # a one-token answer has no TPOT to miss
    assert not meets_slos(rec(0.0, [0.1, 0.2], success=False), {"e2el": 10})


def test_summary_on_a_hand_made_run():
    records = [
        rec(0.0, [0.5, 1.0, 1.5], prompt_len=100, group="long"),  # ttft .5, tpot .5, e2e 1.5
        rec(0.0, [0.1, 0.2], prompt_len=10, group="short"),  # ttft .1, tpot .1, e2e .2
        rec(1.0, [1.2, 1.4, 1.6, 2.0], prompt_len=20, group="short"),  # ttft .2, tpot .8/3, e2e 1.0
        RequestRecord(prompt_len=7, arrival_time=0.5, end_time=0.6, success=False, error="HTTP 400: bad",
                      group="short"),
    ]
    s = summarize(records, goodput_slos={"ttft": 0.3, "e2el": 1.2}, percentiles=(50, 95))
    assert s.num_requests == 4 and s.completed == 3 and s.failed == 1
    assert s.duration_s == pytest.approx(2.0)
    assert s.total_input_tokens == 130 and s.total_output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(139 / 2)
    assert s.ttft_ms.mean == pytest.approx(800 / 3)
    assert s.ttft_ms.median == pytest.approx(200)
    assert s.tpot_ms.p(95) == pytest.approx(np.percentile([500, 100, 800 / 3], 95))
    assert s.e2el_ms.max == pytest.approx(1500)
    assert s.itl_ms.count == 2 + 1 + 3
    assert s.peak_concurrency == 2
    assert s.good_requests == 2  # the short ones; the long one misses both SLOs; the failure counts as bad
    assert s.goodput == pytest.approx(1.0)
    assert s.goodput_fraction == pytest.approx(0.5)
    assert s.errors == ["HTTP 400: bad"]
    d = s.to_dict()
    assert d["ttft_ms"]["p95"] == pytest.approx(s.ttft_ms.p(95))

    groups = summarize_by_group(records, percentiles=(50, 95))
    assert list(groups) == ["long", "short"]
    assert groups["long"].completed == 1 and groups["short"].completed == 2 and groups["short"].failed == 1
    # Group rates use the whole run's duration, so they add up to the total.
    assert groups["long"].output_throughput + groups["short"].output_throughput == pytest.approx(s.output_throughput)
    assert groups["long"].ttft_ms.median == pytest.approx(500)


def test_summary_of_nothing_does_not_crash():
    s = summarize([])
    assert s.completed == 0 and math.isnan(s.request_throughput)


def test_parse_percentiles():
    assert parse_percentiles("50, 99.9") == (50.0, 99.9)
    with pytest.raises(ValueError):
        parse_percentiles("101")
