"""Read a LoRA adapter saved by `peft` (`save_pretrained`) into a `LoRAAdapter`.

The directory holds adapter_config.json (rank `r`, `lora_alpha`, `use_rslora`, the target
modules, and many settings for variants of LoRA) and adapter_model.safetensors, whose
tensors are named after the base model's modules:

    base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight   [out, r]

The delta peft adds to a target's output is lora_B(lora_A(x)) * scaling, with scaling =
lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA); the scaling is folded into B here.
Which modules an adapter adapts is read from the tensors present (so target_modules as a
regex, layers_to_transform and exclude_modules need nothing more); every setting that
changes what the adapter computes beyond plain LoRA on the seven projections is refused
with a ValueError naming it, never silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tokenloom.model.llama import ModelArgs
from tokenloom.model.lora import TARGETS, LoRAAdapter, module_shape, targets_for

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# init_lora_weights values that leave the base model's weights as they were (the others --
# PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, MiCA -- move part of the base weights into the adapter,
# so the adapter is only right on top of a base model peft changed)
_SAFE_INITS = (True, False, "gaussian", "eva", "orthogonal")
# settings whose non-empty value makes something other than plain LoRA: (key, why)
_REFUSED = (
    ("use_dora", "DoRA (weight-decomposed) adapters are not supported"),
    ("modules_to_save", "adapters that also save whole modules (modules_to_save) are not supported"),
    ("lora_bias", "adapters with a bias on lora_B are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style weights) is not supported"),
    ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
    ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("trainable_token_indices", "trainable_token_indices (embedding rows) are not supported"),
    ("use_qalora", "QALoRA adapters are not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("target_parameters", "adapters on parameters (target_parameters) are not supported"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora) is not supported"),
    ("megatron_config", "Megatron-parallel adapters are not supported"),
)


def _dir(path: str | Path) -> Path:
    """`path` with a leading ~ expanded; FileNotFoundError for a ~user that does not exist."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise FileNotFoundError(f"no LoRA adapter at {str(path)!r}: cannot expand its ~") from None


def read_adapter_config(path: str | Path) -> dict:
    """adapter_config.json of the adapter at `path`; FileNotFoundError when there is none."""
    p = _dir(path) / CONFIG_FILE
    try:
        found = p.is_file()
    except (OSError, ValueError):  # a name too long for the filesystem, say: nothing is there either
        found = False
    if not found:
        raise FileNotFoundError(f"no LoRA adapter at {str(path)!r}: {CONFIG_FILE} not found "
                                f"(a directory made by peft's save_pretrained is expected)")
    try:
        cfg = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return cfg


def lora_scaling(cfg: dict, targets: dict = TARGETS) -> tuple[int, float]:
    """(r, scaling) of a plain LoRA config on a model whose adaptable modules are `targets`;
    ValueError naming any setting we do not run."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"peft_type {peft_type!r}: only LORA adapters are supported")
    for key, why in _REFUSED:
        if cfg.get(key):
            raise ValueError(f"{key}: {why}")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise ValueError(f"bias {bias!r}: adapters that train biases are not supported (only 'none')")
    init = cfg.get("init_lora_weights", True)
    if init not in _SAFE_INITS:
        raise ValueError(f"init_lora_weights {init!r} changes the base model's weights; only adapters whose base "
                         f"is the unchanged model are supported (convert it with peft's "
                         f"path_initial_model_for_weight_conversion)")
    wanted = cfg.get("target_modules")
    named = [wanted] if isinstance(wanted, str) and re.fullmatch(r"\w+", wanted) else wanted
    if isinstance(named, list):
        odd = [m for m in named if m not in targets]
        if odd:
            raise ValueError(f"target_modules {odd}: LoRA on these is not supported (supported: {', '.join(targets)})")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def load_peft_adapter(path: str | Path, a: ModelArgs, max_rank: int, dtype: torch.dtype,
                      name: str | None = None) -> LoRAAdapter:
    """The adapter at `path` for base model `a`, its B scaled, in `dtype` on the CPU.

    FileNotFoundError: no adapter there; ValueError: an adapter we cannot run on this model
    (a refused setting, a module we do not adapt, a shape that is not this model's, a rank
    above --max-lora-rank)."""
    path = _dir(path)
    cfg = read_adapter_config(path)
    targets = targets_for(a)
    r, scaling = lora_scaling(cfg, targets)
    if r > max_rank:
        raise ValueError(f"the adapter's rank r={r} is above --max-lora-rank {max_rank}; raise --max-lora-rank")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        legacy = " (only adapter_model.bin is there: re-save it with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise FileNotFoundError(f"no LoRA adapter weights at {str(path)!r}: {WEIGHTS_FILE} not found{legacy}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                what = "LoRA on this module is" if "lora_" in key else "weights other than LoRA's A and B are"
                raise ValueError(f"{WEIGHTS_FILE}: {key!r}: {what} not supported "
                                 f"(supported: {', '.join(targets)} of each decoder layer)")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in targets:
                raise ValueError(f"{WEIGHTS_FILE}: {key!r}: LoRA on {module} is not supported "
                                 f"(supported: {', '.join(targets)})")
            if layer >= a.num_layers:
                raise ValueError(f"{WEIGHTS_FILE}: {key!r}: the base model has {a.num_layers} layers")
            pairs.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    if not pairs:
        raise ValueError(f"{WEIGHTS_FILE} at {str(path)!r} holds no LoRA weights")
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(a.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_FILE}: {where} has lora_{next(iter(ab))} without its pair")
        in_f, out_f = module_shape(a, module)
        A, B = ab["A"], ab["B"]
        if tuple(A.shape) != (r, in_f) or tuple(B.shape) != (out_f, r):
            raise ValueError(f"{WEIGHTS_FILE}: {where}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not "
                             f"fit this model with r={r} (expected {(r, in_f)} and {(out_f, r)}): an adapter for "
                             f"another base model?")
        layers[layer][module] = (A.to(dtype).contiguous(), (B.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(name=name or path.name, rank=r, layers=layers)
