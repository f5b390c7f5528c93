"""What the machine and the model are, in the numbers a decode step's cost depends on.

- `hardware`    datasheet figures of accelerators (bandwidth, peak FLOP/s, memory) and `local`
- `microbench`  the same figures measured on this machine (torch), cached
- `model_spec`  a checkpoint's shape as parameter counts, bytes and FLOPs per token
- `host`        this machine's name (torch-free)
- `placement`   how N data-parallel replicas split this machine (serve -dp starts them so, sim reads it back)

Below both `bench` (the roofline command) and `sim` (estimate, simulate), which read them;
imports only `model` (presets, packed weights) and `kernels`.
"""
