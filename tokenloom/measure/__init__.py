"""What the benchmarks (bench/) and the simulator (sim/) share, below both: the workload
(`workloads`: requests, their generation and command-line flags), per-request records and
their summary (`metrics`), step records from step events (`steps`) and the report tables
and JSON (`report`).  A benchmark measures the real engine and the simulator predicts it in
the same terms; neither imports the other (.importlinter).
"""
