"""GGUF checkpoints (model/weights/formats/gguf*.py) read as transformers' own GGUF loader reads them.

Files are written by the `gguf` package's writer from models transformers built (tests/gguf_writer.py:
llama.cpp's names and q/k row order; the K-quants packed by an independent packer).  Then:

1. The blocks: our reading of Q4_0 / Q8_0 / Q5_0 blocks is exactly the format's own dequantizer's
   values, and `gguf.quants.dequantize` reads back exactly what our K-quant packer put in.
2. Parity, per type we claim, against `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
   (which dequantizes everything): the same greedy tokens under chunked prefill, first-step
   log-probabilities within 1e-4, and each matrix we keep quantized dequantizes to exactly
   transformers' weight -- so the kept integers and float16 scales are the file's, unrounded.
3. The file is a model path like a directory: LLM(file), LLM(directory holding it), the tokenizer and
   chat template from its metadata, `tokenloom serve file.gguf`; what we cannot read is refused at
   load naming the tensor and type, the architecture, or the ambiguous directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import K_PACKERS, hf_from_gguf, write_gguf
from test_parity import _hf_greedy
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tokenloom import LLM, SamplingParams
from tokenloom.model.tools.tokenizer_builder import DEFAULT_CHAT_TEMPLATE, default_tokenizer
from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.weights.formats.gguf import read_config
from tokenloom.model.weights.formats.gguf_blocks import dense, kept_blocks
from tokenloom.model.weights.formats.gguf_file import read_gguf
from tokenloom.model.weights.loader import load_tokenizer, resolve_model_path
from tokenloom.model.weights.quantization import QuantEmbedding, QuantLinear

T = gguf.GGMLQuantizationType
# K-quants need rows of whole 256-weight super-blocks: hidden and intermediate are multiples of 256.
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, initializer_range=0.08,
            bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda tie: LlamaConfig(**TINY, tie_word_embeddings=tie, rope_theta=1e4),
    "qwen2": lambda tie: Qwen2Config(**TINY, tie_word_embeddings=tie, rope_theta=1e6),
    # head_dim 128: transformers' GGUF table has no key for it and uses Qwen3's default
    "qwen3": lambda tie: Qwen3Config(**TINY, tie_word_embeddings=tie, head_dim=128, rope_theta=1e6),
}
CHUNKED = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=64, dtype="float32")


def _tokenizer_json() -> str:
    return default_tokenizer(300).to_str()


def _model(model_type: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[model_type](tie)).float().eval()


def _every(qtype):
    return lambda name, shape: qtype


def _llama_cpp_default(qtype):
    """What llama.cpp's quantizer does for a Q4_0 / Q8_0 file: the output matrix (the tied
    embedding where there is none) in Q6_K, everything else in the type."""
    return lambda name, shape: T.Q6_K if name == "output.weight" else qtype


def _q4_k_m(name, shape):
    """A Q4_K_M-style mix: Q6_K for v, down and the output matrix, Q5_K for the first layer's
    gate, Q4_K for the rest (llama.cpp's mix varies v and down by layer; these are its types)."""
    if name == "output.weight" or ".attn_v." in name or ".ffn_down." in name:
        return T.Q6_K
    return T.Q5_K if name == "blk.0.ffn_gate.weight" else T.Q4_K


_K_MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q4_K, "attn_output": T.Q4_K, "ffn_gate": T.Q4_K,
            "ffn_up": T.Q8_0, "ffn_down": T.Q4_K, "output": T.Q6_K, "token_embd": T.Q4_K}


def _k_mixed(name, shape):
    """Q4_K beside the types it may meet: a Q4_0 part in the fused q/k/v (kept: int4 with float32
    scales, the Q4_0 part's offsets zero), a Q8_0 up beside a Q4_K gate (dequantized)."""
    return _K_MIXED[name.split(".")[-2]]


_MIXED = {"attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1, "ffn_gate": T.Q5_1,
          "ffn_up": T.Q5_1, "ffn_down": T.Q4_0, "output": T.Q8_0, "token_embd": T.Q4_0}


def _mixed(name, shape):
    """The legacy block types side by side: q/k/v of three kept types (fused into one int8
    matrix), the affine Q4_1 / Q5_1 dequantized, an int4 down, an int8-group head."""
    return _MIXED[name.split(".")[-2]]


# name: (family, tied, types, what our layer-0 linears and head run as: kept scheme or "dense")
CASES = {
    "F32-llama": ("llama", False, _every(T.F32), ("dense", "dense", "dense", "dense", "dense")),
    "F16-qwen2-tied": ("qwen2", True, _every(T.F16), ("dense", "dense", "dense", "dense", "dense")),
    "BF16-qwen3": ("qwen3", False, _every(T.BF16), ("dense", "dense", "dense", "dense", "dense")),
    "Q8_0-llama-tied": ("llama", True, _every(T.Q8_0), ("gguf-q8_0",) * 5),
    "Q4_0-qwen2": ("qwen2", False, _llama_cpp_default(T.Q4_0), ("gguf-q4_0",) * 4 + ("dense",)),
    "Q4_0-pure-llama-tied": ("llama", True, _every(T.Q4_0), ("gguf-q4_0",) * 5),
    "Q4_K_M-qwen3": ("qwen3", False, _q4_k_m, ("dense", "gguf-q4_k", "dense", "dense", "dense")),
    "Q4_K-llama-tied": ("llama", True, _every(T.Q4_K), ("gguf-q4_k",) * 5),
    "Q4_K-mixed-qwen2": ("qwen2", False, _k_mixed, ("gguf-q4_k", "gguf-q4_k", "dense", "gguf-q4_k", "dense")),
    "Q6_K-llama-tied": ("llama", True, _every(T.Q6_K), ("dense",) * 5),
    "mixed-legacy-llama": ("llama", False, _mixed, ("gguf-q8_0", "dense", "dense", "gguf-q4_0", "gguf-q8_0")),
}


def _write(tmp_path: Path, name: str, **kw) -> Path:
    family, tie, types, _ = CASES[name]
    if family not in gguf.MODEL_ARCH_NAMES.values():  # transformers' GGUF loader maps names through it
        pytest.skip(f"the installed gguf package does not know {family}, so transformers cannot read it")
    d = tmp_path / name
    d.mkdir()
    return write_gguf(_model(family, tie), _tokenizer_json(), d / f"{name}.gguf", types, **kw)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in (7, 40)]  # 40: prefill in chunks


# ---------------------------------------------------------------- blocks


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q5_0])
def test_kept_blocks_are_the_formats_own_values(tmp_path, qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    w[3, :32] = 0  # an all-zero block: scale 0
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    t = read_gguf(path).tensors[0]
    q, d = kept_blocks(t)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (48, 3)
    lo, hi = {T.Q4_0: (-8, 7), T.Q8_0: (-127, 127), T.Q5_0: (-16, 15)}[qtype]
    assert q.min() >= lo and q.max() <= hi
    want = torch.from_numpy(gguf.quants.dequantize(gguf.GGUFReader(str(path)).tensors[0].data, qtype))
    assert torch.equal(q.float() * d.float().repeat_interleave(32, dim=1), want)
    assert torch.equal(dense(t, torch.float32), want)
    rows = torch.randperm(48)
    q2, d2 = kept_blocks(t, rows)
    assert torch.equal(q2, q[rows]) and torch.equal(d2, d[rows])


@pytest.mark.parametrize("qtype", sorted(K_PACKERS, key=lambda t: t.name))
def test_gguf_reads_back_what_our_k_quant_packer_wrote(qtype):
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    raw, values = K_PACKERS[qtype](w)
    assert raw.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    assert np.array_equal(gguf.quants.dequantize(raw, qtype), values)
    # and the packer is a quantizer: the values stay near the weights
    bits = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[qtype]
    assert np.abs(values - w).max() < 8 * np.abs(w).max() / 2**bits


# ---------------------------------------------------------------- parity


def _layer0(model) -> list:
    layer = model.layers[0]
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
            model.lm_head]


def _hf_matrices(hf) -> list[torch.Tensor]:
    a, m = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    return [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
            torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight, hf.lm_head.weight]


@pytest.mark.parametrize("name", sorted(CASES))
def test_generates_what_transformers_gguf_loader_generates(tmp_path, name):
    path = _write(tmp_path, name)
    hf = hf_from_gguf(path)
    prompts = _prompts()
    ref = _hf_greedy(hf, prompts, 6)
    llm = LLM(str(path), **CHUNKED)
    model = llm.llm_engine.loaded.model
    # what each matrix runs as, and a kept one holds exactly the file's values
    for mod, want, hf_w in zip(_layer0(model), CASES[name][3], _hf_matrices(hf)):
        got = mod.matrix.scheme.name if isinstance(mod, QuantLinear) else "dense"
        assert got == want, (mod, want)
        if isinstance(mod, QuantLinear):
            assert torch.equal(mod.matrix.dequantize(), hf_w.detach())
    if CASES[name][1] and CASES[name][3][-1] != "dense":
        assert isinstance(model.embed_tokens, QuantEmbedding)  # tied: one kept matrix, looked up and streamed
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    graphs = llm.llm_engine.runner.graphs
    assert graphs is None or not getattr(graphs, "eager", {}), graphs.eager  # every decode replayed
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < 1e-4


def test_kept_matrices_run_through_pytorch_ops_where_our_kernel_does_not(tmp_path):
    """--linear-backend torch: the same kept blocks, dequantized by PyTorch ops each call."""
    path = _write(tmp_path, "Q4_0-pure-llama-tied")
    prompts = _prompts()[:1]
    ref = _hf_greedy(hf_from_gguf(path), prompts, 4)
    llm = LLM(str(path), linear_backend="torch", **CHUNKED)
    assert type(llm.llm_engine.loaded.model.layers[0].mlp.down_proj.matrix).__name__ == "TorchQuantized"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_dequantized_matrices_can_be_requantized_with_our_scheme(tmp_path):
    """--quantization int8 on a K-quant file: the dequantized matrices go to our int8 (what a
    K-quant file needs to stream fewer bytes than bf16); the engine then generates what
    transformers generates with those int8 matrices put into its own model."""
    from test_quantization import _fake_quantized_hf

    path = _write(tmp_path, "Q6_K-llama-tied")
    llm = LLM(str(path), quantization="int8", **CHUNKED)
    assert {m.matrix.scheme.name for m in _layer0(llm.llm_engine.loaded.model)} == {"int8"}
    hf = _fake_quantized_hf(path, "int8", load=hf_from_gguf)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, 6)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < 1e-4


# ---------------------------------------------------------------- the file as a model path


@pytest.mark.parametrize("name", ["F32-llama", "F16-qwen2-tied", "BF16-qwen3", "Q4_K_M-qwen3"])
def test_config_and_tokenizer_are_what_transformers_reads_from_the_file(tmp_path, name):
    """Our header reader and config (read_gguf, transformers' key table) give the model transformers'
    own `AutoConfig.from_pretrained(dir, gguf_file=...)` describes, and the tokenizer is the one
    `AutoTokenizer` builds."""
    from transformers import AutoConfig, AutoTokenizer

    path = _write(tmp_path, name, chat_template=DEFAULT_CHAT_TEMPLATE)
    ours = read_config(path)
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    arch = ours["architectures"][0]
    assert model_args_fields(ours, arch) == model_args_fields({**theirs, "architectures": [arch]}, arch)
    tok, ref = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(tok) is type(ref) and tok.chat_template == ref.chat_template == DEFAULT_CHAT_TEMPLATE
    text = "class A:\n    def f(self):  # comment\n        return 'x' * 3"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)


def test_config_dtype_and_head_size_come_from_the_file(tmp_path):
    assert read_config(_write(tmp_path, "F16-qwen2-tied"))["torch_dtype"] == "float16"
    cfg = read_config(_write(tmp_path, "BF16-qwen3"))
    assert cfg["torch_dtype"] == "bfloat16" and cfg["head_dim"] == 128
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    cfg = read_config(_write(tmp_path, "Q4_0-qwen2"))
    assert cfg["torch_dtype"] == "float32" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 2


def test_directory_holding_one_gguf_is_a_model_path_with_its_tokenizer_and_chat_template(tmp_path):
    path = _write(tmp_path, "Q8_0-llama-tied", chat_template=DEFAULT_CHAT_TEMPLATE)
    assert resolve_model_path(str(path.parent)) == path
    tok = load_tokenizer(str(path))
    text = "def add(a, b):\n    return a + b"
    assert tok.decode(tok(text)["input_ids"]) == text
    llm = LLM(str(path.parent), **CHUNKED)
    assert llm.llm_engine.eos_token_ids == frozenset({2})
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    shutil.copy(path, path.parent / "other.gguf")
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        resolve_model_path(str(path.parent))


def test_serve_answers_openai_requests_from_a_gguf_file(tmp_path):
    import openai
    from server_fixtures import ThreadedServer
    from test_readme import free_port

    path = _write(tmp_path, "Q4_0-pure-llama-tied")
    server = ThreadedServer([str(path), "--port", str(free_port()), "--max-model-len", "64",
                             "--num-kv-blocks", "32", "--block-size", "8"]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == [str(path)]
        r = client.completions.create(model=str(path), prompt="def f(x):", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
    finally:
        server.stop()


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tmp_path):
    d = tmp_path / "q2k"
    d.mkdir()
    path = write_gguf(_model("llama", False), _tokenizer_json(), d / "m.gguf",
                      lambda name, shape: T.Q2_K if name == "blk.1.ffn_up.weight" else T.Q8_0)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q2_K.*supported tensor types: F32"):
        LLM(str(path), **CHUNKED)


def test_unsupported_architecture_is_refused_naming_it(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"general\.architecture 'phi3' is not supported"):
        LLM(str(path), **CHUNKED)


@pytest.mark.parametrize("factor", [1.0, 8.0])
def test_rotary_frequency_factors_are_refused_unless_all_one(tmp_path, factor):
    """Llama 3.1+ files carry their rotary scaling only as `rope_freqs` factors, which transformers'
    GGUF reading drops; we refuse those rather than run a different model (factors of 1 change nothing)."""
    family, tie, types, _ = CASES["Q8_0-llama-tied"]
    d = tmp_path / "rope"
    d.mkdir()
    path = d / "m.gguf"
    freqs = np.ones(32, dtype=np.float32)
    freqs[20:] = factor
    write_gguf(_model(family, tie), _tokenizer_json(), path, types, extra={"rope_freqs.weight": freqs})
    if factor == 1.0:
        assert read_config(path)["architectures"] == ["LlamaForCausalLM"]
        LLM(str(path), **CHUNKED)
    else:
        with pytest.raises(ValueError, match="rope_freqs"):
            LLM(str(path), **CHUNKED)


def test_a_split_file_is_refused(tmp_path):
    path = _write(tmp_path, "F32-llama")
    split = tmp_path / "m-00001-of-00002.gguf"
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(split), "llama")
    w.add_uint16("split.count", 2)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    del reader
    with pytest.raises(ValueError, match="split.count 2.*llama-gguf-split --merge"):
        read_config(split)


def test_gguf_config_round_trips_through_json(tmp_path):
    """The config dict is plain data (the engine logs and serves it)."""
    json.dumps(read_config(_write(tmp_path, "Q4_K_M-qwen3")))
