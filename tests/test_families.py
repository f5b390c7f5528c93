"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers, on checkpoints transformers saves.

Three halves.  First, config.json -> our model's fields, read off what transformers' own
classes build from the same dict (per-layer windows, soft-caps, the attention scale, the
embedding scale, q/k norms, every rotation's frequencies -- Gemma 3's local one, Phi-3's
short and long LongRoPE tables), in the 4.x and 5.x formats, and the settings we refuse.
Second, tiny models built with transformers' config classes and saved with `save_pretrained`
generate transformers' greedy tokens, with every step's log-probabilities within 1e-4, under
chunked prefill, preemption and prefix caching, on each attention backend and over two
tensor-parallel ranks; Phi-3's LongRoPE both from the start (prompts past
original_max_position_embeddings) and across the switch mid-generation, where transformers
recomputes the cache and so do we.  Third, `make-model`'s presets: written through the
config classes, and each family's chat template rendering exactly what transformers'
apply_chat_template renders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenloom import LLM, SamplingParams
from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.rope_scaling import rope_inv_freqs
from tokenloom.model.tools.tokenizer_builder import CHAT_FORMATS, add_chat_tokens, default_tokenizer, save_hf_tokenizer

from test_parity import _hf, _hf_greedy

S, F = "sliding_attention", "full_attention"
ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=32, vocab_size=64)
LONGROPE = {"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0]}
ORIGINAL_LEN = 32  # the test Phi-3's pretraining length: the long rotation past it

# ---- config.json -> our fields, against what transformers builds --------------------------


def _cfg(model_type: str, **kw) -> dict:
    if model_type == "phi3":  # Phi3Config's pad id (32000) lies outside these vocabularies
        kw = {"pad_token_id": 0, "eos_token_id": 2, **kw}
    return {"model_type": model_type, "architectures": [ARCH[model_type]], **kw}


CONFIG_CASES = {
    "gemma2-defaults": _cfg("gemma2", **SMALL),  # head_dim 256, caps 50 / 30, window 4096, alternating
    "gemma2-v4-rope-no-caps": _cfg("gemma2", **SMALL, head_dim=16, rope_theta=5e5, attn_logit_softcapping=None,
                                   final_logit_softcapping=None, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                   layer_types=[F, S, S], sliding_window=7, query_pre_attn_scalar=40),
    "gemma3-defaults": _cfg("gemma3_text", **{**SMALL, "num_hidden_layers": 7}),  # every 6th layer full
    "gemma3-v4-local-base": _cfg("gemma3_text", **SMALL, head_dim=32, rope_theta=2e5, rope_local_base_freq=500.0,
                                 rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=2,
                                 sliding_window=12, final_logit_softcapping=7.0, attn_logit_softcapping=9.0),
    "gemma3-v5-nested": _cfg("gemma3_text", **SMALL, head_dim=16, rope_parameters={
        S: {"rope_type": "default", "rope_theta": 3000.0},
        F: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}},
        layer_types=[S, F, F]),
    "phi3-defaults": _cfg("phi3", **SMALL),
    "phi3-window-kv": _cfg("phi3", **{**TINY, "num_key_value_heads": 1}, sliding_window=48, rope_theta=3e4),
    "phi3-su-top-level-original": _cfg("phi3", **TINY, original_max_position_embeddings=ORIGINAL_LEN,
                                       rope_scaling={"type": "su", **LONGROPE}),
    "phi3-longrope-attention-factor": _cfg("phi3", **TINY, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "attention_factor": 1.3, **LONGROPE}),
}


def _what_transformers_builds(cfg: dict) -> dict:
    """Our fields as read off the model transformers builds from `cfg` (structure on the meta
    device) and off its rotary module (real tables on the CPU)."""
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    inner, phi3 = model.model, cfg["model_type"] == "phi3"
    attn, mlp = inner.layers[0].self_attn, inner.layers[0].mlp
    q_out = attn.qkv_proj.out_features if phi3 else attn.q_proj.out_features + 2 * attn.k_proj.out_features
    heads = hf_cfg.num_attention_heads
    kv_heads = (q_out // attn.head_dim - heads) // 2
    rotary = type(inner.rotary_emb)(config=hf_cfg)
    if cfg["model_type"] == "gemma3_text":  # one rotation per layer type
        tables = {t: (getattr(rotary, f"{t}_inv_freq"), getattr(rotary, f"{t}_attention_scaling")) for t in (F, S)}
    else:
        tables = {F: (rotary.inv_freq, rotary.attention_scaling)}
    if rotary.rope_type == "longrope":  # the table transformers switches to past the pretraining length
        orig = hf_cfg.rope_parameters["original_max_position_embeddings"]
        tables["long"] = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, seq_len=orig + 1)
    return dict(
        vocab_size=inner.embed_tokens.num_embeddings,
        hidden_size=inner.embed_tokens.embedding_dim,
        intermediate_size=mlp.down_proj.in_features,
        num_layers=len(inner.layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=attn.head_dim,
        rms_norm_eps=inner.norm.variance_epsilon if phi3 else inner.norm.eps,
        max_position_embeddings=hf_cfg.max_position_embeddings,
        tie_word_embeddings=model.lm_head.weight is inner.embed_tokens.weight,
        qkv_bias=(attn.qkv_proj if phi3 else attn.q_proj).bias is not None,
        o_bias=attn.o_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm"),
        hidden_act=hf_cfg.hidden_act if phi3 else hf_cfg.hidden_activation,
        # the window each layer's attention passes on (Phi-3: the config's, on every layer)
        layer_windows=tuple(hf_cfg.sliding_window if phi3 else layer.self_attn.sliding_window
                            for layer in inner.layers),
        scale=attn.scaling,
        # Gemma 2 hands its cap to the attention function; Gemma 3 holds one but passes none on
        attn_softcap=getattr(attn, "attn_logit_softcapping", None) if cfg["model_type"] == "gemma2" else None,
        final_softcap=getattr(hf_cfg, "final_logit_softcapping", None),
        embed_scale=getattr(inner.embed_tokens, "scalar_embed_scale", None),
        sandwich_norm=hasattr(inner.layers[0], "pre_feedforward_layernorm"),
        layer_types=tuple(hf_cfg.layer_types) if not phi3 else None,
        tables=tables,
    )


def _ours(cfg: dict) -> dict:
    f = model_args_fields(json.loads(json.dumps(cfg)), cfg["architectures"][0])
    windows = tuple(f["sliding_window"] if t == S else None for t in f["layer_types"])
    max_pos = f["max_position_embeddings"]
    full, scale, long_from = rope_inv_freqs(f["head_dim"], f["rope_theta"], f["rope_scaling"], max_pos)
    tables = {F: (full[0], scale)}
    if long_from is not None:
        tables["long"] = (full[1], scale)
    if f["local_rope_theta"] is not None:
        local, local_scale, _ = rope_inv_freqs(f["head_dim"], f["local_rope_theta"], f["local_rope_scaling"], max_pos)
        tables[S] = (local[0], local_scale)
    return {**f, "layer_windows": windows, "scale": (f["query_pre_attn_scalar"] or f["head_dim"]) ** -0.5,
            "tables": tables, "layer_types": f["layer_types"] if cfg["model_type"] != "phi3" else None}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_fields_match_what_transformers_builds(case):
    cfg = CONFIG_CASES[case]
    ours, ref = _ours(cfg), _what_transformers_builds(json.loads(json.dumps(cfg)))
    ref_tables, our_tables = ref.pop("tables"), ours["tables"]
    assert set(our_tables) == set(ref_tables)
    for name, (inv_freq, factor) in ref_tables.items():
        assert torch.equal(our_tables[name][0], inv_freq), f"{name} rotary frequencies differ"
        assert our_tables[name][1] == pytest.approx(factor, rel=1e-12)
    assert {k: ours[k] for k in ref} == ref


@pytest.mark.parametrize("case", ["gemma2-v4-rope-no-caps", "gemma3-v4-local-base", "phi3-su-top-level-original"])
def test_config_that_transformers_saves_reads_the_same_as_the_dict_it_came_from(tmp_path, case):
    """transformers 5 rewrites the 4.x keys (Gemma 3: one rope_parameters dict per layer type)."""
    old = CONFIG_CASES[case]
    AutoConfig.for_model(**old).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved
    arch = old["architectures"][0]
    assert model_args_fields(saved, arch) == model_args_fields(old, arch)


@pytest.mark.parametrize("cfg, message", [
    (_cfg("gemma2", **SMALL, use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_cfg("gemma3_text", **SMALL, hidden_activation="relu"), "hidden_activation"),
    (_cfg("gemma3_text", **SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0}), "per layer type"),
    (_cfg("phi3", **TINY, partial_rotary_factor=0.75), "partial_rotary_factor"),  # Phi-4-mini
    (_cfg("phi3", **TINY, rope_scaling={"type": "linear", "factor": 2.0}), "longrope"),
    (_cfg("phi3", **TINY, rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                        "long_factor": [1.0] * 8}), "short_factor"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY,
      "rope_scaling": {"rope_type": "longrope", **LONGROPE}}, "Phi-3 only"),
])
def test_settings_the_model_cannot_honour_are_refused(tmp_path, cfg, message):
    with pytest.raises(ValueError, match=message):
        model_args_fields(cfg, cfg["architectures"][0])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), max_model_len=64)


# ---- checkpoints saved by transformers: parity -----------------------------------------------

# window 8 on layer 0, full attention on layer 1; both soft-capped; scale from query_pre_attn_scalar
GEMMA2 = dict(**TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=1.5)
# sliding layers rotate with base 100, the full one with 1e6 scaled linearly; q/k norms
GEMMA3 = dict(**{**TINY, "num_hidden_layers": 3}, head_dim=32, sliding_window=8, layer_types=[S, F, S],
              query_pre_attn_scalar=24, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0},
              rope_local_base_freq=100.0, final_logit_softcapping=1.5)
CHECKPOINTS = {
    "gemma2": lambda: Gemma2Config(**GEMMA2),
    "gemma3": lambda: Gemma3TextConfig(**GEMMA3),
    # fused qkv / gate_up in the checkpoint; LongRoPE past 32 tokens; a 24-token window
    "phi3": lambda: Phi3Config(**TINY, sliding_window=24, original_max_position_embeddings=ORIGINAL_LEN,
                               rope_scaling={"type": "longrope", **LONGROPE}, rope_theta=1e4,
                               pad_token_id=0, eos_token_id=2),
}
FORMAT = {"gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
PROMPT_LENS = (3, 17, 40, 9, 30, 25)  # Phi-3: 40 long from the start; 17, 25, 30 cross the switch
NEW_TOKENS = 12
STRESS = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=40, max_model_len=128)


def _save_checkpoint(config, out: Path, chat: str, seed: int = 0) -> Path:
    """A random-weight fp32 checkpoint written by transformers' `save_pretrained`, with our
    tokenizer (and the family's chat markers) beside it.  Weights redrawn larger than
    transformers' init, so greedy decisions are well apart; Gemma's norm weights (offsets
    from 1) around 0 and its embeddings scaled down by its sqrt(hidden) multiplier, as
    make-model draws them."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    gemma = config.model_type.startswith("gemma")
    embed_std = 0.25 / (config.hidden_size ** 0.5 if gemma else 1.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    fmt = CHAT_FORMATS[chat]
    tok = add_chat_tokens(default_tokenizer(config.vocab_size - len(fmt.special_tokens)), fmt)
    save_hf_tokenizer(tok, out, model_max_length=config.max_position_embeddings, chat_template=fmt.template)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = _save_checkpoint(CHECKPOINTS[family](), tmp_path_factory.mktemp(family), FORMAT[family])
        return made[family]

    return get


def _prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lens]


def _generate(llm: LLM, prompts, n: int = NEW_TOKENS, logprobs: int | None = None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs),
                        use_tqdm=False)


def _assert_logprobs_match(hf, prompt: list[int], completion, tol: float = 1e-4, switch: int | None = None) -> None:
    """Every generated step's top log-probabilities against transformers' forward over the
    sequence up to it.  One forward per rotation: Phi-3 rotates a sequence longer than
    `switch` with its long table, so steps on either side of it are scored apart, each
    over its own length, as transformers' generation computes them."""
    ids, start = prompt + completion.token_ids, len(prompt)
    groups: dict[bool, list[int]] = {}
    for i in range(len(completion.logprobs)):  # step i is predicted from the first start + i tokens
        groups.setdefault(switch is not None and start + i > switch, []).append(i)
    for steps in groups.values():
        with torch.no_grad():
            want = hf(torch.tensor([ids[:start + steps[-1]]])).logits[0].float().log_softmax(-1)
        for i in steps:
            for tok, lp in completion.logprobs[i].items():
                assert abs(lp.logprob - want[start + i - 1, tok].item()) < tol, (i, tok)


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_greedy_tokens_and_logprobs_match_transformers_under_chunking_and_preemption(checkpoint, family):
    path = checkpoint(family)
    prompts = _prompts()
    hf = _hf(path)
    ref = _hf_greedy(hf, prompts, NEW_TOKENS)
    events = []
    llm = LLM(str(path), observers=[events.append], **STRESS)
    outs = _generate(llm, prompts, logprobs=3)
    assert [o.outputs[0].token_ids for o in outs] == ref
    switch = ORIGINAL_LEN if family == "phi3" else None
    for p, o in zip(prompts, outs):
        _assert_logprobs_match(hf, p, o.outputs[0], switch=switch)
    eng = llm.llm_engine
    assert any(e.phase == "prefill_chunk" for ev in events for e in ev.entries)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_free == STRESS["num_kv_blocks"]
    if family == "phi3":  # the prompts that grew past the 32-token switch (25, 30) were recomputed there
        crossing = [p for p in prompts if len(p) <= ORIGINAL_LEN < len(p) + NEW_TOKENS - 1]
        assert len(crossing) == 2 and eng.scheduler.num_recomputes == 2
        assert eng.scheduler_config.recompute_past == ORIGINAL_LEN
    if family == "gemma2":  # soft-capped scores: the plan names the reference path
        assert "soft-capped scores (2) through the torch reference" in eng.summary()


def test_features_change_transformers_own_output(tmp_path):
    """The checkpoints above exercise what they claim: transformers' own greedy decisions
    (the next token after every prefix of a 30-token prompt) change when the attention
    soft-cap, the window or Gemma 3's local base is taken away (the final cap is monotonic:
    its effect is on the log-probabilities checked above)."""
    prompt = torch.tensor(_prompts(1, (30,)))

    def decisions(config, name):
        with torch.no_grad():
            return _hf(_save_checkpoint(config, tmp_path / name, "gemma"))(prompt).logits[0].argmax(-1)

    base2 = decisions(Gemma2Config(**GEMMA2), "g2")
    assert (decisions(Gemma2Config(**{**GEMMA2, "attn_logit_softcapping": None}), "g2c") != base2).sum() >= 5
    assert (decisions(Gemma2Config(**{**GEMMA2, "sliding_window": 512}), "g2w") != base2).sum() >= 5
    base3 = decisions(Gemma3TextConfig(**GEMMA3), "g3")
    assert (decisions(Gemma3TextConfig(**{**GEMMA3, "rope_local_base_freq": 1e6}), "g3r") != base3).sum() >= 5


def test_phi3_longrope_without_a_window_replays_long_decodes(tmp_path):
    """Without a sliding window nothing keeps Phi-3 off the decode graphs: a long request's
    positions carry the long table's offset and its context lengths must not (it once
    attended past its block table and failed).  transformers' greedy tokens, replayed."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.runner.cpu_graphs import CpuDecodeGraphs

    if not cpu_kernels.graph_enabled():
        pytest.skip("the op-list replayer did not build here")
    config = Phi3Config(**TINY, sliding_window=None, original_max_position_embeddings=ORIGINAL_LEN,
                        rope_scaling={"type": "longrope", **LONGROPE}, rope_theta=1e4, pad_token_id=0, eos_token_id=2)
    path = _save_checkpoint(config, tmp_path / "phi3-nowindow", "phi3")
    prompts = _prompts()
    llm = LLM(str(path), **STRESS)
    graphs = llm.llm_engine.runner.graphs
    assert isinstance(graphs, CpuDecodeGraphs)
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    assert graphs.lists and not graphs.eager  # decode steps were replayed
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]


def test_phi3_longrope_blocks_are_cached_apart_from_short_ones(checkpoint):
    """A request past the switch never reads K/V that a shorter one rotated with the short
    table, however many tokens they share; long ones share among themselves."""
    path = checkpoint("phi3")
    head = _prompts(2, (24,))[0]
    tails = _prompts(3, (4, 16, 20))
    a, b, c = head, head + tails[0], head + tails[1]  # 24 and 28 tokens: short; 40: long
    d = c + tails[2][:4]  # 44: long, shares c's 40
    hf = _hf(path)
    llm = LLM(str(path), **{**STRESS, "num_kv_blocks": 64})
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {}
    for wave in ([a], [b, c], [d]):
        for p, o in zip(wave, llm.generate([{"prompt_token_ids": p} for p in wave], sp, use_tqdm=False)):
            outs[len(p)] = o
    for p in (a, b, c, d):
        assert outs[len(p)].outputs[0].token_ids == _hf_greedy(hf, [p], 3)[0]
    assert outs[len(b)].num_cached_tokens == 24  # short reads short
    assert outs[len(c)].num_cached_tokens == 0  # long never reads short
    assert outs[len(d)].num_cached_tokens == 40  # long reads long
    assert llm.llm_engine.scheduler.num_recomputes == 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_prefix_cache_hits_under_pressure_match_transformers(checkpoint, family):
    """Shared 37-token heads in two waves: the second hits the cache through sliding and full
    layers alike, memory pressure evicts cached blocks, and every output is transformers'."""
    path = checkpoint(family)
    head = _prompts(3, (37,))[0]
    prompts = [head + t for t in _prompts(4, (1, 6, 11, 3))]
    ref = _hf_greedy(_hf(path), prompts, 8)
    llm = LLM(str(path), **{**STRESS, "num_kv_blocks": 16, "max_model_len": 64})
    first = _generate(llm, prompts[:1], 8)
    rest = _generate(llm, prompts[1:], 8)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert rest[0].num_cached_tokens == 36
    assert llm.llm_engine.kv.pool.num_evictions > 0 and llm.llm_engine.kv.pool.num_free == 16


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_each_attention_backend_matches_transformers(checkpoint, family, backend):
    """The reference (SDPA, explicit math where scores are capped) and the Triton kernels
    (windows in the kernel; Gemma 2's capped layers through the reference) on CPU tensors
    under Triton's interpreter."""
    path = checkpoint(family)
    prompts = _prompts(5, (5, 21))  # past the window of 8
    llm = LLM(str(path), attention_backend=backend, **STRESS)
    assert llm.llm_engine.runner.attn.name == backend
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, 6)] == _hf_greedy(_hf(path), prompts, 6)


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_two_tensor_parallel_ranks_match_transformers(checkpoint, family):
    path = checkpoint(family)
    prompts = _prompts(6, (9, 40, 28))  # Phi-3: one long from the start, one crossing
    llm = LLM(str(path), tensor_parallel_size=2, **STRESS)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts, 8)] == _hf_greedy(_hf(path), prompts, 8)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_bfloat16_stays_close_to_transformers_bfloat16(checkpoint, family):
    """bf16 through the CPU fast paths (packed linears, our ops and decode kernel where the
    layer's kind allows), prefill and three decode steps."""
    path = checkpoint(family)
    hf16 = _hf(path, torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    p = _prompts(7, (40,))[0]
    o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                     use_tqdm=False)[0].outputs[0]
    _assert_logprobs_match(hf16, p, o, tol=0.1)


# ---- make-model presets and chat templates ---------------------------------------------------

PRESETS = {"tiny-gemma2": "Gemma2Config", "tiny-gemma3": "Gemma3TextConfig", "tiny-phi3": "Phi3Config"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three."}]
RENDERED = {
    "tiny-gemma2": "<|bos|><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello."
                   "<end_of_turn>\n<start_of_turn>user\nCount to three.<end_of_turn>\n<start_of_turn>model\n",
    "tiny-phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello.<|end|>\n"
                 "<|user|>\nCount to three.<|end|>\n<|assistant|>\n",
}
RENDERED["tiny-gemma3"] = RENDERED["tiny-gemma2"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_is_written_by_transformers_and_chats_in_its_family_format(model_factory, preset):
    path = model_factory(preset)
    hf = _hf(path)
    assert type(hf.config).__name__ == PRESETS[preset]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:  # transformers' own tensor names
        assert set(f.keys()) == set(hf.state_dict()) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == RENDERED[preset]
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    llm = LLM(str(path), max_model_len=128)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == want
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>" if "gemma" in preset else "<|end|>")
    assert {tok.eos_token_id, end_of_turn} <= llm.llm_engine.eos_token_ids  # a turn's end stops generation
    assert out.outputs[0].token_ids == _hf_greedy(hf, [want], 8)[0]
