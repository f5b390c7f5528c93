"""`tokenloom make-model`: random-weight Hugging Face directories in real architectures' shapes.

No hub here, so tests and benchmarks run on models the project makes: the config of a
preset, weights drawn from a seeded normal distribution under the exact tensor names a
real checkpoint uses, and a byte-level BPE tokenizer trained by the project.  The
result is an ordinary HF directory: transformers loads it, and so does tokenloom.  Its
config.json is written by transformers' own config class for the architecture, so our
checkpoints carry exactly what transformers writes (in transformers 5: `rope_parameters`,
`layer_types`, `dtype`), not a format only we produce.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.tools.presets import CHAT_FORMATS, TINY_PRESETS, get_preset
from tokenloom.model.tools.tokenizer_builder import (CHAT_FORMATS as TEMPLATES, add_chat_tokens, default_tokenizer,
                                                     save_hf_tokenizer)

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint of this config, as transformers names them
    (Phi-3 stores q/k/v and gate/up fused; Gemma has two more norms per layer)."""
    a = model_args_fields(cfg, cfg["architectures"][0])
    fused = a["architecture"] == "Phi3ForCausalLM"
    h, inter, v = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    nh, nkv, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    qkv_bias, o_bias = a["qkv_bias"], a["o_bias"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(a["num_layers"]):
        p = f"model.layers.{i}."
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * hd, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (nh * hd, h)
            shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
            shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if a["qk_norm"]:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if i in a["moe_layers"]:
            shapes.update(_expert_shapes(p, a, a["architecture"] == "MixtralForCausalLM"))
        elif fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if a["sandwich_norm"]:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not a["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _expert_shapes(prefix: str, a: dict, mixtral: bool) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts under the hub's names: Mixtral's
    `block_sparse_moe.experts.N.w1/w2/w3`, the Qwen families' `mlp.experts.N.gate_proj/...`
    (what transformers 5's `save_pretrained` writes too), Qwen2-MoE's shared expert and gate."""
    h, inter, e = a["hidden_size"], a["moe_intermediate_size"], a["num_experts"]
    block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {block + "gate.weight": (e, h)}
    for j in range(e):
        shapes[f"{block}experts.{j}.{names[0]}.weight"] = (inter, h)
        shapes[f"{block}experts.{j}.{names[1]}.weight"] = (inter, h)
        shapes[f"{block}experts.{j}.{names[2]}.weight"] = (h, inter)
    shared = a["shared_expert_intermediate_size"]
    if shared:
        shapes[block + "shared_expert.gate_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.up_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.down_proj.weight"] = (h, shared)
        shapes[block + "shared_expert_gate.weight"] = (1, h)
    return shapes


def make_model(preset: str, out: str | Path, *, seed: int = 0, dtype: str = "float32",
               init_std: float | None = None, max_shard_bytes: int | None = None,
               tokenizer_vocab: int | None = None, overrides: dict | None = None) -> Path:
    """Write a random-weight HF model directory for `preset`; returns its path.

    init_std: weight scale. Tiny presets default to a larger scale than real models'
    0.02 so their random logits are well separated (greedy parity tests then compare
    real decisions, not float-rounding coin flips between near-tied tokens)."""
    cfg = get_preset(preset)
    cfg.update(overrides or {})
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_SAVE_DTYPES)}")
    cfg["torch_dtype"] = dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    std = init_std if init_std is not None else (0.25 if preset in TINY_PRESETS else 0.02)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    fields = model_args_fields(cfg, cfg["architectures"][0])
    # Gemma stores norm weights as offsets from 1 (x * (1 + w)): centred on 0, not 1
    norm_centre = 1.0 - fields["norm_offset"]
    # Gemma multiplies embeddings by sqrt(hidden): drawn that much smaller, so the token's own
    # embedding does not drown the layers' output (a random model would echo its input)
    embed_std = std / (fields["embed_scale"] or 1.0)
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = norm_centre + 0.1 * torch.randn(shape, generator=gen)  # not all-ones, so a missed norm shows up
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = embed_std * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        tensors[name] = t.to(_SAVE_DTYPES[dtype]).contiguous()
    _save_weights(tensors, out, max_shard_bytes)
    write_hf_config(cfg, out)
    # the family's chat format: its template, its markers appended to the trained vocabulary,
    # its end-of-turn token a stop token beside EOS (as the family's generation_config has it)
    fmt = TEMPLATES[CHAT_FORMATS.get(cfg["architectures"][0], "chatml")]
    vocab = tokenizer_vocab or min(cfg["vocab_size"], 4096)
    tok = add_chat_tokens(default_tokenizer(vocab - len(fmt.special_tokens)), fmt)
    save_hf_tokenizer(tok, out, model_max_length=cfg.get("max_position_embeddings", 2048), chat_template=fmt.template)
    eos = cfg.get("eos_token_id", 2)
    if fmt.end_of_turn is not None:
        eos = [eos, tok.token_to_id(fmt.end_of_turn)]
    gen_cfg = {"bos_token_id": cfg.get("bos_token_id", 1), "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


def write_hf_config(cfg: dict, out: Path) -> None:
    """config.json as transformers' config class for `cfg["model_type"]` writes it."""
    from transformers import AutoConfig  # a heavy import, only where a model is made

    cfg = dict(cfg)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(out)


def _save_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
