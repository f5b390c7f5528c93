"""Which code runs on this machine: every backend choice, resolved once into a `BackendPlan`.

    linear     panels | onednn | torch    how each matmul runs, per weight format (model/weights/loader.py packs for it)
    attention  cpu | triton | sdpa        how attention reads the paged KV cache (model/attention.py);
                                          soft-capped layers (Gemma 2) through the reference where
                                          the backend's kernels do not cap scores
    ops        torch | cpu | triton       norms, rotary, SwiGLU (model/ops.py)
    flat       on | off                   layers call linears as plain functions (model/layers.py `bound_linear`)
    graphs     on | off (why)             decode steps replay CUDA graphs (runner/cuda_graphs.py)
    cpu graphs on | off (why)             decode steps replay recorded op lists on CPUs (runner/cpu_graphs.py)
    lora       cpu | torch | none         LoRA adapters' shrink/expand (model/lora.py), with --enable-lora

`resolve_backends` is the one place an "auto" becomes a name and an explicit choice that
cannot run here becomes an error (not a silent fallback).  It runs right after the
settings, before the weights load; the loader, the runner and tensor-parallel workers
receive the plan and build what it names without deciding anything again.  A new backend
or weight format is a name here and a constructor where it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tokenloom.config import BackendPlan

LINEAR_BACKENDS = ("auto", "panels", "onednn", "torch")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "sdpa")
OPS_BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backends(device: torch.device, dtype: torch.dtype, fields: Mapping[str, Any], *, linear: str = "auto",
                     attention: str = "auto", ops: str = "auto", quantization: str | None = None,
                     compile: bool = False, enforce_eager: bool = False, tensor_parallel_size: int = 1,
                     pack_weights: bool = True, prequantized: str | None = None, lora: bool = False) -> BackendPlan:
    """The plan for a model whose parsed config is `fields` (`model/hf_config.model_args_fields`:
    head_dim and attn_softcap are read) on `device` in `dtype`, from the user's
    choices (each "auto" or a name).  `prequantized`: the checkpoint's own quantization, in
    words (model/weights/formats `describe_prequantized`).  ValueError for a choice that
    cannot run here."""
    tp = tensor_parallel_size > 1
    if prequantized is not None:
        linear_name = _prequantized_linear(linear, prequantized, quantization, device, dtype, tp, pack_weights)
    else:
        linear_name = _linear(linear, quantization, device, dtype, tp, pack_weights)
    attention_name = _attention(attention, device, dtype, int(fields["head_dim"]))
    fallback = _attention_fallback(attention_name, fields.get("attn_softcap"))
    ops_name = _ops(ops, device, dtype, attention_name)
    fused_kv_write = ops_name != "torch" and not compile
    # Linears called as plain functions, without nn.Module's dispatch; torch.compile traces
    # the modules (their custom ops), so there they keep module calls.
    flat = not compile
    moe = bool(fields.get("num_experts"))
    lora_name = _lora(device, dtype, tp, compile, moe) if lora else None
    graphs_off = _graphs_off(device, enforce_eager, tp, compile, attention_name, fallback, moe=moe, lora=lora)
    windowed = "sliding_attention" in (fields.get("layer_types") or ())
    cpu_graphs_off = _cpu_graphs_off(device, enforce_eager, tp, compile, attention_name, fallback, windowed,
                                     moe=moe, lora=lora)
    return BackendPlan(device=device.type, dtype=str(dtype).removeprefix("torch."), linear=linear_name,
                       quantization=quantization, attention=attention_name, ops=ops_name,
                       fused_kv_write=fused_kv_write, flat_calls=flat, compile=compile,
                       cuda_graphs=graphs_off is None, cuda_graphs_off=graphs_off,
                       cpu_graphs=cpu_graphs_off is None, cpu_graphs_off=cpu_graphs_off, prequantized=prequantized,
                       attention_fallback=fallback, lora=lora_name)


def plan_for_args(args, device: torch.device, dtype: torch.dtype, fields: Mapping[str, Any],
                  prequantized: str | None = None) -> BackendPlan:
    """`resolve_backends` for an `EngineArgs` (and the checkpoint's own quantization, if any)."""
    return resolve_backends(device, dtype, fields, linear=args.linear_backend, attention=args.attention_backend,
                            ops=args.ops_backend, quantization=args.quantization, compile=args.compile,
                            enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                            prequantized=prequantized, lora=args.enable_lora)


def torch_dtype(plan: BackendPlan) -> torch.dtype:
    return getattr(torch, plan.dtype)


def _linear(name: str, quantization: str | None, device: torch.device, dtype: torch.dtype, tp: bool,
            pack_weights: bool) -> str:
    """`--linear-backend`: panels (our GEMM, weights in its column panels), onednn (oneDNN's
    packed weights), torch (nn.Linear as loaded: cuBLAS on GPUs); auto = panels where our
    kernel wins on this CPU, else oneDNN where it runs, else torch.  With `quantization`,
    panels is our quantized CPU kernel and torch PyTorch ops."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.packed_linear import packing_supported

    if name not in LINEAR_BACKENDS:
        raise ValueError(f"--linear-backend must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    if not pack_weights:
        name = "torch"
    if quantization is not None:
        from tokenloom.model.weights.quantization import kernels_available, parse_scheme

        parse_scheme(quantization)
        if tp:
            raise ValueError("--quantization is not supported with --tensor-parallel-size > 1 yet")
        if name == "onednn":
            raise ValueError("--quantization runs on --linear-backend panels (our CPU kernel) or torch, not onednn")
        panels = name in ("auto", "panels") and kernels_available(device)
        if name == "panels" and not panels:
            raise ValueError("--linear-backend panels with --quantization needs --device cpu and our CPU kernels built")
        return "panels" if panels else "torch"
    if name == "auto":
        return ("panels" if cpu_kernels.preferred(device, dtype)
                else "onednn" if packing_supported(device, dtype) else "torch")
    if name == "panels" and (device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)
                             or not cpu_kernels.load()):
        raise ValueError("--linear-backend panels needs --device cpu, float32 or bfloat16 and our CPU kernels built")
    if name == "onednn" and not packing_supported(device, dtype):
        raise ValueError(f"--linear-backend onednn: oneDNN cannot run packed {dtype} linears here")
    return name


def _prequantized_linear(name: str, prequantized: str, quantization: str | None, device: torch.device,
                         dtype: torch.dtype, tp: bool, pack_weights: bool) -> str:
    """The linear backend for a checkpoint that arrives quantized (model/weights/formats/):
    panels = our quantized CPU kernel for its quantized layers and our GEMM for the layers it
    keeps dense (the LM head); torch = PyTorch ops for both (GPUs, or no kernels here)."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.quantization import kernels_available

    if name not in LINEAR_BACKENDS:
        raise ValueError(f"--linear-backend must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    if quantization is not None:
        raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized ({prequantized}); "
                         "leave --quantization unset")
    if tp:
        raise ValueError(f"a pre-quantized checkpoint ({prequantized}) with --tensor-parallel-size > 1 is not "
                         "supported yet")
    if name == "onednn":
        raise ValueError("a pre-quantized checkpoint runs on --linear-backend panels (our CPU kernels) or torch, "
                         "not onednn")
    if not pack_weights:
        return "torch"
    panels = (kernels_available(device) and dtype in (torch.float32, torch.bfloat16) and cpu_kernels.load())
    if name == "panels" and not panels:
        raise ValueError("--linear-backend panels with a pre-quantized checkpoint needs --device cpu, float32 or "
                         "bfloat16 and our CPU kernels built")
    return "panels" if panels and name in ("auto", "panels") else "torch"


def _attention(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`--attention-backend`; auto: Triton on CUDA where it imports, our C++ kernel on CPUs
    where it builds, SDPA elsewhere."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.kernels import triton as triton_kernels

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    cpu_op = cpu_kernels.decode_attention_op(device, dtype, head_dim) if device.type == "cpu" else None
    if name == "auto":
        if device.type == "cuda" and triton_kernels.available():
            return "triton"
        return "cpu" if cpu_op is not None else "sdpa"
    if name == "triton":
        if not triton_kernels.available():
            raise ValueError("--attention-backend triton: the triton package is not importable (pip install triton)")
        if device.type == "cpu" and not triton_kernels.interpreting():
            raise ValueError("--attention-backend triton runs on CUDA devices; on CPU tensors only under "
                             "TRITON_INTERPRET=1 (Triton's interpreter, for tests)")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"--attention-backend triton does not run on {device.type} devices")
    if name == "cpu" and cpu_op is None:
        raise ValueError("--attention-backend cpu needs --device cpu, float32 or bfloat16, a head size that is a "
                         "multiple of 8 and our CPU kernels built (TOKENLOOM_CPU_ATTENTION not 0)")
    return name


def _ops(name: str, device: torch.device, dtype: torch.dtype, attention: str) -> str:
    """`--ops-backend`; auto follows the attention backend (triton with triton; our C++ ops
    on CPUs where they build; PyTorch's elsewhere)."""
    from tokenloom.model.ops import cpu_ops_available

    if name not in OPS_BACKENDS:
        raise ValueError(f"--ops-backend must be one of {', '.join(OPS_BACKENDS)}, got {name!r}")
    cpu_ok = device.type == "cpu" and cpu_ops_available(dtype)
    if name == "auto":
        return "triton" if attention == "triton" else "cpu" if cpu_ok else "torch"
    if name == "triton" and attention != "triton":
        raise ValueError("--ops-backend triton writes the KV cache the triton attention backend reads; "
                         "use it with --attention-backend triton")
    if name == "cpu" and not cpu_ok:
        raise ValueError("--ops-backend cpu needs --device cpu, float32 or bfloat16 and our CPU kernels built "
                         "(TOKENLOOM_CPU_FUSED not 0)")
    return name


def _lora(device: torch.device, dtype: torch.dtype, tp: bool, compile: bool, moe: bool = False) -> str:
    """How LoRA deltas run with --enable-lora: our C++ shrink/expand on CPUs where it builds,
    PyTorch's matmuls elsewhere.  ValueError where adapters cannot run yet."""
    from tokenloom.kernels import cpu as cpu_kernels

    if moe:
        raise ValueError("--enable-lora is not supported for mixture-of-experts models yet")
    if tp:
        raise ValueError("--enable-lora is not supported with --tensor-parallel-size > 1 yet")
    if compile:
        raise ValueError("--enable-lora is not supported with --compile yet (each step's adapter rows are Python "
                         "data the compiled graph would guard on)")
    return "cpu" if cpu_kernels.lora_op(device, dtype) is not None else "torch"


def _attention_fallback(attention: str, softcap: float | None) -> str | None:
    """Which layers the torch reference attends for instead of `attention`, and why; None
    where the backend runs every layer.  A model's kind of attention a backend's kernels
    cannot run is decided here, once: the backend then routes those layers (model/attention.py)."""
    from tokenloom.model.attention import SOFTCAP_NATIVE

    if softcap is None or SOFTCAP_NATIVE[attention]:
        return None
    return f"soft-capped scores ({softcap:g}) through the torch reference: the {attention} kernels do not cap"


def _graphs_off(device: torch.device, enforce_eager: bool, tp: bool, compile: bool, attention: str,
                fallback: str | None = None, moe: bool = False, lora: bool = False) -> str | None:
    """Why decode steps do not replay CUDA graphs, or None where they do."""
    if device.type != "cuda":
        return "not on a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if tp:
        return "tensor parallel"
    if compile:
        return "--compile"
    if lora:
        return "--enable-lora (each step's adapter rows change the work)"
    if attention != "triton":
        return f"the {attention} attention backend cannot be captured (use triton)"
    if fallback is not None:
        return "some layers attend through the torch reference, which cannot be captured"
    if moe:
        return "mixture-of-experts steps pick their experts on the host (model/moe.py)"
    return None


def _cpu_graphs_off(device: torch.device, enforce_eager: bool, tp: bool, compile: bool, attention: str,
                    fallback: str | None, windowed: bool, moe: bool = False, lora: bool = False) -> str | None:
    """Why decode steps do not replay recorded op lists on a CPU (runner/cpu_graphs.py), or
    None where they do.  A replay repeats the ops of the step it recorded: the forward must
    do the same ops at every step of a batch size, reading nothing back on the host."""
    from tokenloom.kernels import cpu as cpu_kernels

    if device.type != "cpu":
        return "not on a CPU"
    if enforce_eager:
        return "--enforce-eager"
    if tp:
        return "tensor parallel (each step communicates)"
    if compile:
        return "--compile"
    if lora:
        return "--enable-lora (each step's adapter rows change the work)"
    if moe:
        return "mixture-of-experts steps pick their experts on the host (model/moe.py)"
    if attention != "cpu":
        return f"the {attention} attention backend builds host-side masks (use cpu)"
    if fallback is not None or windowed:
        return "some layers attend through the torch reference, whose masks are host work"
    if not cpu_kernels.graph_enabled():
        return "the op-list replayer (kernels/cpu_graph.cpp) did not build or TOKENLOOM_CPU_GRAPHS=0"
    return None
