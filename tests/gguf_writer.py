"""Test helper: write a transformers model as a GGUF file with the `gguf` package's own writer.

What llama.cpp's converter would write, from a model transformers built: the architecture's
metadata, the tokenizer (byte-level BPE: tokens, types, merges, special ids, chat template),
and every tensor under llama.cpp's name, a llama file's q / k rows permuted as llama.cpp's
converter permutes them.  Each matrix is stored in the type a `types` function picks for it:

* F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: `gguf.quants.quantize` (the package implements them);
* Q4_K, Q5_K, Q6_K, which the package can only read: packed here byte by byte from the block
  layouts llama.cpp publishes (ggml-common.h `block_q4_K`, `block_q5_K`, `block_q6_K`) -- an
  independent packer, whose integers and scales `k_quant` also returns, so a test can check
  that `gguf.quants.dequantize` reads back exactly the values put in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
QK_K = 256


# ---------------------------------------------------------------- K-quant packers


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [B, 8] -> the 12 bytes of `block_q4_K.scales`:
    bytes 0-3 the low 6 bits of scales 0-3 (top 2 bits: scale 4-7's high bits), bytes 4-7 the
    same for mins, bytes 8-11 the low 4 bits of scale 4-7 and min 4-7."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    return out


def _affine_k(w: np.ndarray, bits: int):
    """Super-blocks [B, 256] -> (d, dmin fp16 [B], 6-bit sc, mn [B, 8], q [B, 256] in 0..2^bits-1)
    with w ~ d sc q - dmin mn per sub-block of 32 (a plain rounding quantizer, not llama.cpp's search)."""
    b = w.shape[0]
    sub = w.reshape(b, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # the min is subtracted: keep it <= 0
    scale = (sub.max(-1) - lo) / (2**bits - 1)
    d = _fp16(np.maximum(scale.max(-1), 1e-8) / 63)
    dmin = _fp16(np.maximum((-lo).max(-1), 1e-8) / 63)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    off = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round((sub + off) / step), 0, 2**bits - 1).astype(np.uint8).reshape(b, QK_K)
    return d, dmin, sc, mn, q


def _values_affine(d, dmin, sc, mn, q) -> np.ndarray:
    b = q.shape[0]
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[..., None]
    off = (dmin.astype(np.float32)[:, None] * mn.astype(np.float32))[..., None]
    return (step * q.reshape(b, 8, 32).astype(np.float32) - off).reshape(b, QK_K)


def pack_q4_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float32 -> (bytes [N, K / 256 * 144], the values those bytes hold [N, K])."""
    n, k = w.shape
    d, dmin, sc, mn, q = _affine_k(w.reshape(-1, QK_K), 4)
    b = q.shape[0]
    qq = q.reshape(b, 4, 2, 32)  # 4 pairs of sub-blocks: low nibble the first of a pair, high the second
    qs = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(b, 128)
    raw = np.concatenate([d.view(np.uint8).reshape(b, 2), dmin.view(np.uint8).reshape(b, 2),
                          _pack_scales_k4(sc, mn), qs], axis=1)
    return raw.reshape(n, -1), _values_affine(d, dmin, sc, mn, q).reshape(n, k)


def pack_q5_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] -> (bytes [N, K / 256 * 176], values): Q4_K's nibbles plus a fifth bit per weight
    in qh (bit 2j of qh[l]: sub-block 2j's element l; bit 2j + 1: sub-block 2j + 1's)."""
    n, k = w.shape
    d, dmin, sc, mn, q = _affine_k(w.reshape(-1, QK_K), 5)
    b = q.shape[0]
    qq = q.reshape(b, 4, 2, 32)
    lo = qq & 15
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(b, 128)
    hi = (q.reshape(b, 8, 32) >> 4).astype(np.uint8)  # [B, sub-block, l]
    qh = np.zeros((b, 32), dtype=np.uint8)
    for j in range(8):
        qh |= hi[:, j] << j
    raw = np.concatenate([d.view(np.uint8).reshape(b, 2), dmin.view(np.uint8).reshape(b, 2),
                          _pack_scales_k4(sc, mn), qh, qs], axis=1)
    return raw.reshape(n, -1), _values_affine(d, dmin, sc, mn, q).reshape(n, k)


def pack_q6_k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] -> (bytes [N, K / 256 * 210], values): 16 sub-blocks of 16 with int8 scales, q in
    -32..31 stored +32 as 4 low bits (ql) and 2 high bits (qh); d fp16 last."""
    n, k = w.shape
    sb = w.reshape(-1, QK_K)
    b = sb.shape[0]
    sub = sb.reshape(b, 16, 16)
    amax = np.abs(sub).max(-1)  # [B, 16]
    sub_scale = amax / 31
    d = _fp16(np.maximum(sub_scale.max(-1), 1e-8) / 127)
    sc = np.clip(np.round(sub_scale / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[..., None]
    q = np.clip(np.round(sub / step), -32, 31).astype(np.int8)  # [B, 16, 16]
    values = (step * q.astype(np.float32)).reshape(n, k)
    u = (q.reshape(b, 2, 4, 32).astype(np.int16) + 32).astype(np.uint8)  # [B, half, quarter, l]
    ql = np.concatenate([u[:, :, 0] & 15 | ((u[:, :, 2] & 15) << 4), u[:, :, 1] & 15 | ((u[:, :, 3] & 15) << 4)],
                        axis=2).reshape(b, 128)  # per half: bytes l (quarters 0 | 2), 32 + l (1 | 3)
    qh = ((u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6))
    raw = np.concatenate([ql, qh.reshape(b, 64), sc.view(np.uint8), d.view(np.uint8).reshape(b, 2)], axis=1)
    return raw.reshape(n, -1), values


K_PACKERS = {T.Q4_K: pack_q4_k, T.Q5_K: pack_q5_k, T.Q6_K: pack_q6_k}


def encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """A float32 matrix in `qtype`'s bytes (or values, for the float types); zero bytes of the
    right size for a type nobody here can write (a file that must be refused, not read)."""
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype in K_PACKERS:
        return K_PACKERS[qtype](w)[0]
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * nbytes), dtype=np.uint8)


# ---------------------------------------------------------------- the file


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[mod]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order: within each head, the rows of the two rotary
    halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(tokenizer_json: str) -> dict:
    """tokens, merges and token types of a `tokenizers` byte-level BPE, as GGUF lists them."""
    tj = json.loads(tokenizer_json)
    vocab = dict(tj["model"]["vocab"])
    for a in tj["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj["added_tokens"] if a.get("special")}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return dict(tokens=tokens, types=types, merges=merges)


def write_gguf(model, tokenizer_json: str, path: Path, types: Callable[[str, tuple[int, ...]], T],
               chat_template: str | None = None, bos: int = 1, eos: int = 2,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """`model` (a transformers Llama / Qwen2 / Qwen3 causal LM) as GGUF file `path`; `types(gguf
    name, shape)` picks each 2-D tensor's type (1-D tensors are F32, as llama.cpp stores them);
    `extra`: more F32 tensors by GGUF name (llama.cpp's rope_freqs, say)."""
    cfg = model.config
    arch = cfg.model_type
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tok = tokenizer_metadata(tokenizer_json)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if chat_template:
        w.add_chat_template(chat_template)
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for hf, t in sd.items():
        if hf.endswith("rotary_emb.inv_freq"):
            continue
        a = t.detach().float().numpy()
        name = gguf_name(hf)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            a = _permute(a, heads if ".attn_q." in name else kv_heads)
        qtype = types(name, a.shape) if a.ndim == 2 else T.F32
        data = encode(a, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path, dtype=torch.float32):
    """transformers' own GGUF loader on the file (it dequantizes every tensor)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
