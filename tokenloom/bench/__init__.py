"""Benchmarks: the seed's figures (tokens/s, TTFT, TPOT, P95 latency, batch quality), measured.

- `workloads`   seeded request lists with arrival times (random, sharegpt-like, mixed-long, prefix)
- `metrics`     pure functions from per-request timelines to TTFT/TPOT/ITL/E2E, goodput, concurrency
- `report`      rich tables and the JSON envelope (config, workload, machine, results)
- `serve`       streaming `/v1/completions` client (`bench serve`); `launcher` starts a real server
- `offline`     the in-process engine with step-event timing; `hf_baseline` the transformers reference
- `throughput`, `latency`, `roofline`, `sweep`: the other `tokenloom bench` commands
"""
