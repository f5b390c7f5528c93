"""Load a Hugging Face checkpoint into tokenloom's own model code.

Accepts a local directory or a hub id (fetched with huggingface_hub), reads
config.json and single or sharded `*.safetensors` (via `model.safetensors.index.json`),
and fuses q/k/v and gate/up projections while copying, so each decode step reads each
weight matrix exactly once (decode at small batch is bound by weight bytes read).  Phi-3
checkpoints store them fused already (`qkv_proj`, `gate_up_proj`, in the same order) and
load as they are; Gemma's RMSNorm weights are stored as offsets from 1 and load as 1 + w.

A GGUF file (or a directory holding one and no config.json) is the other kind of model path:
its metadata stands in for config.json and the tokenizer files, and its tensors load through
model/weights/formats/gguf_weights.py (Q4_0 / Q8_0 blocks kept in our kernels' layouts).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenloom.config import BackendPlan
from tokenloom.model.llama import CausalLM, ModelArgs
from tokenloom.model.weights.formats import describe_prequantized, open_reader
from tokenloom.model.weights.formats.gguf import gguf_path
from tokenloom.model.weights.parallel import TPGroup, shard_model
from tokenloom.model.registry import is_headless, resolve_architecture
from tokenloom.kernels import glibc_heap

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory as is, a GGUF file (or a directory holding one GGUF file and no
    config.json) as that file; anything else is treated as a hub id and downloaded."""
    p = Path(model).expanduser()
    gguf = gguf_path(p)
    if gguf is not None:
        return gguf
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json (nor a .gguf file); is it a Hugging Face model directory?")
        return p
    if p.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is not a directory nor a .gguf file")
    from huggingface_hub import snapshot_download  # only needed for hub ids

    local = snapshot_download(
        repo_id=model,
        revision=revision,
        allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
    )
    return Path(local)


def load_config(path: Path) -> dict:
    if gguf_path(path) is not None:
        from tokenloom.model.weights.formats.gguf import read_config

        return read_config(gguf_path(path))
    with open(path / "config.json") as f:
        return json.load(f)


def load_tokenizer(name: str, revision: str | None = None):
    """transformers' tokenizer for a model directory, hub id or tokenizer directory -- for a
    GGUF file, the one it describes in its metadata."""
    gguf = gguf_path(Path(name).expanduser())
    if gguf is not None:
        from tokenloom.model.weights.formats.gguf import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(gguf)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, revision=revision)


def resolve_dtype(dtype: str, cfg: dict, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        d = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        if device.type == "cpu" and d == torch.float16:
            return torch.float32  # fp16 matmuls are slow or missing on CPUs
        return d
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"--dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available; use --device cpu")
    return d


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


# checkpoint name -> (our parameter name, which slice of a fused weight)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
}
# A SwiGLU's gate and up fuse into its gate_up_proj wherever it sits: a dense layer's `mlp`,
# an expert `mlp.experts.N` (model/moe.py), Qwen2-MoE's `mlp.shared_expert`.
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
# Mixtral's hub names: the block is `block_sparse_moe`, an expert's gate / down / up are w1 / w2 / w3.
_MIXTRAL_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(.+)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# Experts stored as one 3D tensor each for all experts (transformers 5's in-memory layout, which
# some checkpoints hold): gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
_STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
STACKED = "stacked experts"  # the shard index `_target` gives such a tensor


def _target(name: str, a: ModelArgs) -> tuple[str, int | str | None] | None:
    """Map a checkpoint tensor name to (our name, shard index or None); None = ignore.  A
    stacked expert tensor maps to (our name with {} for the expert, `STACKED`)."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return (None if a.tie_word_embeddings else ("lm_head.weight", None))
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    mx = _MIXTRAL_EXPERT.match(rest)
    if mx:
        rest = f"mlp.experts.{mx[1]}.{_MIXTRAL_PROJ[mx[2]]}.{mx[3]}"
    elif rest.startswith("block_sparse_moe."):
        rest = "mlp." + rest.removeprefix("block_sparse_moe.")
    st = _STACKED.match(rest)
    if st:
        return f"layers.{layer}.mlp.experts.{{}}.{st[1]}.weight", STACKED
    mod, _, kind = rest.rpartition(".")
    if mod in _FUSED:
        fused, idx = _FUSED[mod]
        return f"layers.{layer}.{fused}.{kind}", idx
    owner, _, proj = mod.rpartition(".")
    if proj in _GATE_UP and owner.startswith("mlp"):
        return f"layers.{layer}.{owner}.gate_up_proj.{kind}", _GATE_UP[proj]
    return f"layers.{layer}.{rest}", None


def _pieces(pname: str, idx: int | str | None, t: torch.Tensor):
    """(our name, shard index, tensor) for each of our parameters a checkpoint tensor fills:
    itself, or one slice per expert of a stacked one (gate_up split into its two halves, so
    each half counts as the fused weight's shard it is)."""
    if idx != STACKED:
        yield pname, idx, t
        return
    if t.dim() != 3:
        raise ValueError(f"{pname.format('*')}: stacked expert weights must be 3D, got shape {tuple(t.shape)}")
    for e in range(t.shape[0]):
        if "gate_up_proj" in pname:
            half = t.shape[1] // 2
            yield pname.format(e), 0, t[e, :half]
            yield pname.format(e), 1, t[e, half:]
        else:
            yield pname.format(e), None, t[e]


def _shard_bounds(param_name: str, idx: int, a: ModelArgs, rows: int) -> tuple[int, int]:
    """Rows of our fused parameter (`rows` in all) that shard `idx` of a checkpoint fills."""
    if "qkv_proj" in param_name:
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][idx]
    i = rows // 2  # gate_up: a dense MLP's, an expert's or a shared expert's
    return [(0, i), (i, 2 * i)][idx]


def _parts(param_name: str) -> int:
    """How many checkpoint tensors a parameter of ours is made of where the checkpoint stores
    them apart (q, k, v; gate, up)."""
    return 3 if "qkv_proj" in param_name else 2 if "gate_up_proj" in param_name else 1


@dataclass
class LoadedModel:
    model: CausalLM
    args: ModelArgs
    hf_config: dict
    path: Path
    dtype: torch.dtype
    device: torch.device
    linear_backend: str = "torch"  # how the linears run: panels | onednn | torch (`load_model`)
    quantization: str | None = None  # weight-only scheme (model/weights/quantization.py), or None
    plan: BackendPlan | None = None  # the backend plan it was loaded for (model/backends.py)

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's tensors (weights, rotary tables) occupy, each shared tensor counted once
        (tied embeddings) and oneDNN-packed weights by their element count.  Panel-packed
        weights (cpu_gemm) include their zero padding to a multiple of 16 rows, but not the
        never-touched alignment slack of their 2 MiB-page mappings (kernels/hugepages.py)."""
        total, extents = 0, {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t is None or t.device.type == "meta":
                continue
            if t.is_mkldnn:  # opaque: no storage to ask, one copy of the elements
                total += t.numel() * t.element_size()
                continue
            # the span of its storage each tensor views, merged per storage
            lo = t.storage_offset() * t.element_size()
            hi = lo + t.numel() * t.element_size()
            key = t.untyped_storage().data_ptr()
            a, b = extents.get(key, (lo, hi))
            extents[key] = (min(a, lo), max(b, hi))
        return total + sum(b - a for a, b in extents.values())


def load_model(path: Path, dtype: str, device: torch.device, max_positions: int, pack_weights: bool = True,
               tp: TPGroup | None = None, linear_backend: str = "auto", quantization: str | None = None,
               plan: BackendPlan | None = None) -> LoadedModel:
    """The checkpoint at `path` as our model on `device`; with `tp`, only this rank's shard
    (model/weights/parallel.py), cut before any weight packing so our kernels run on it.

    The matmuls are packed (or quantized) for `plan.linear` (model/backends.py decides it,
    with the dtype, before anything loads).  Without a plan, one is resolved here from
    `dtype`, `linear_backend` and `quantization` (int8 | int4 | int4-g128: model/weights/quantization.py)."""
    cfg = load_config(path)
    arch = resolve_architecture(cfg)
    a = ModelArgs.from_hf_config(cfg, arch)
    headless = is_headless(cfg)  # a base model (sentence-transformers saves one): no LM head, names unprefixed
    if headless:
        a = dataclasses.replace(a, tie_word_embeddings=True)  # no head of its own to load (it pools, never samples)
    if plan is None:
        from tokenloom.model.backends import resolve_backends

        plan = resolve_backends(device, resolve_dtype(dtype, cfg, device), dataclasses.asdict(a),
                                linear=linear_backend, quantization=quantization, pack_weights=pack_weights,
                                tensor_parallel_size=tp.size if tp is not None else 1,
                                prequantized=describe_prequantized(cfg))
    tdtype = getattr(torch, plan.dtype)
    gguf = gguf_path(path)
    files = [] if gguf is not None else _weight_files(path)
    with torch.device("meta"):
        model = CausalLM(a, max_positions)
    # a checkpoint quantized by GPTQ / AWQ / compressed-tensors: its quantized layers (formats/)
    prequant = open_reader(cfg, plan.prequantized, files, lambda n: _target(n, a), model)
    ropes = {name: getattr(model, name) for name in ("rope", "local_rope")}  # built on the CPU, in float32,
    for name in ropes:  # even under the meta device: moved, not re-made
        setattr(model, name, None)
    model = model.to_empty(device=device)
    for name, rope in ropes.items():
        setattr(model, name, rope.to(device) if rope is not None else None)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # checkpoint tensors copied into each parameter of ours
    whole: set[str] = set()  # our linears the checkpoint stores fused already (Phi-3): one tensor each
    with torch.no_grad():
        if gguf is not None:
            if tp is not None and tp.size > 1:
                raise ValueError("--tensor-parallel-size > 1 does not load GGUF checkpoints yet")
            from tokenloom.model.weights.formats.gguf_weights import load_gguf_weights
            from tokenloom.model.weights.quantization import kernels_available

            load_gguf_weights(gguf, model, a, params, filled, tdtype, device,
                              kernels=plan.linear != "torch" and kernels_available(device), place=_target,
                              bounds=_shard_bounds)
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names = list(sf.keys())
            for name in names:
                tgt = _target("model." + name if headless else name, a)
                if tgt is not None and tgt[1] is None:
                    whole.add(tgt[0].rpartition(".")[0])
                if prequant is not None and prequant.take(f, name):
                    continue
                if tgt is None:
                    continue
                # One mapping per tensor: pages of the mmapped file are released as soon as
                # the tensor is copied, so loading never holds the file and the model at once.
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    t = sf.get_tensor(name)
                    for pname, idx, part in _pieces(*tgt, t):
                        if pname not in params:
                            raise ValueError(f"checkpoint tensor {name!r} has no place in {arch} ({pname})")
                        if a.norm_offset and pname.endswith("norm.weight"):
                            part = part.float() + a.norm_offset  # Gemma: x * (1 + w), in float32 as the reference's
                        p = params[pname]
                        if idx is None:
                            if tuple(part.shape) != tuple(p.shape):
                                raise ValueError(f"{name}: checkpoint shape {tuple(part.shape)} != expected "
                                                 f"{tuple(p.shape)}")
                            # copy=True: a zero-copy view would pin the whole mmapped file in memory
                            p.data = part.to(device=device, dtype=tdtype, copy=True)
                        else:
                            lo, hi = _shard_bounds(pname, idx, a, p.shape[0])
                            if p.dtype != tdtype:
                                p.data = torch.empty(p.shape, dtype=tdtype, device=device)
                            p.data[lo:hi].copy_(part)
                        filled[pname] = filled.get(pname, 0) + 1
                    del t, part
        if prequant is not None:
            prequant.install(model, filled, panels=plan.linear == "panels", dtype=tdtype, device=device)
    for pname, p in params.items():
        if filled.get(pname, 0) != (1 if pname.rpartition(".")[0] in whole else _parts(pname)):
            raise ValueError(f"checkpoint at {path} is missing weights for {pname}")
    model.eval()
    del params  # drop our references, so packing can free each unpacked weight as it goes
    if tp is not None and tp.size > 1:
        a = shard_model(model, a, tp)
    if plan.quantization is not None:
        from tokenloom.model.weights.quantization import parse_scheme, quantize_model

        quantize_model(model, parse_scheme(plan.quantization), panels=plan.linear == "panels")
    elif plan.linear == "panels":
        model.prepack_panels()
    elif plan.linear == "onednn":
        model.prepack()
    if device.type == "cpu":
        glibc_heap.release_free_memory()
    return LoadedModel(model=model, args=a, hf_config=cfg, path=path, dtype=tdtype, device=device,
                       linear_backend=plan.linear, quantization=plan.quantization, plan=plan)


def load_eos_token_ids(path: Path, cfg: dict, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    gen = path / "generation_config.json"
    if gen.exists():
        with open(gen) as f:
            add(json.load(f).get("eos_token_id"))
    if not ids:
        add(cfg.get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None and not ids:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
