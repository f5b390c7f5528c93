"""LoRA adapters: many at once, in one batch with the base model, proven against `peft`.

Checkpoints are written by transformers (`save_pretrained`), adapters by peft
(`get_peft_model(...).save_pretrained`) with lora_B drawn non-zero, so each adapter really
changes what the model says.  The reference for a prompt on an adapter is peft's own model
(`PeftModel.from_pretrained`) generating greedily; ours runs every prompt of a mixed batch
(adapter 1, adapter 2, the base model) together, under chunked prefill and small KV blocks,
with our C++ shrink/expand and with PyTorch's matmuls, with enough slots for both adapters
and with one (then the scheduler keeps each step to one adapter).  Then: the prefix cache
never shares a block across adapters; peft settings we do not run are refused by name; and
the server lists, serves, loads and unloads adapters over real HTTP (uvicorn on 127.0.0.1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_hf_checkpoints import TINY, _save_checkpoint
from test_parity import _hf, _hf_greedy
from test_families import GEMMA2
from test_families import _save_checkpoint as _save_family_checkpoint
from transformers import Gemma2Config, Phi3Config, Qwen2Config

from server_fixtures import ThreadedServer
from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.bench.launcher import free_port
from tokenloom.config import EngineArgs, LoRAConfig, SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager, root_key
from tokenloom.core.scheduler import Scheduler
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.lora import LoRARows, apply_torch
from tokenloom.request import Request

N = 12  # tokens generated per prompt
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=120, max_model_len=128, seed=0)


def _adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    """A peft adapter of `base`, lora_B drawn non-zero (peft starts it at zero), saved by peft."""
    model = get_peft_model(_hf(base), LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = _save_checkpoint(Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e6), root / "base")
    return {
        "base": base,
        # every projection, plain scaling alpha / r
        "a1": _adapter(base, root / "a1", 1, r=8, lora_alpha=16, target_modules=ALL),
        # some projections of one layer, rsLoRA's alpha / sqrt(r), a smaller rank
        "a2": _adapter(base, root / "a2", 2, r=4, lora_alpha=8, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1]),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (5, 19, 11, 33, 9, 26)]


def _greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """peft's model (transformers' without an adapter) generating greedily, prompt by prompt."""
    model = _hf(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return _hf_greedy(model, prompts, N)


def _peft_greedy(made: dict[str, Path], adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    return _greedy(made["base"], made[adapter] if adapter else None, prompts)


@pytest.fixture(scope="module")
def mixed(made):
    """Six prompts on adapter 1, adapter 2 and the base model, each with its peft reference."""
    prompts = _prompts()
    which = ["a1", "a2", None, "a1", None, "a2"]
    refs = {}
    for name in ("a1", "a2", None):
        idx = [i for i, w in enumerate(which) if w == name]
        for i, toks in zip(idx, _peft_greedy(made, name, [prompts[i] for i in idx])):
            refs[i] = toks
    loras = {"a1": LoRARequest("a1", 1, str(made["a1"])), "a2": LoRARequest("a2", 2, str(made["a2"]))}
    return prompts, [loras[w] if w else None for w in which], [refs[i] for i in range(len(prompts))], which


def _generate(llm: LLM, prompts, loras, events=None):
    if events is not None:
        llm.add_observer(events.append)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), lora_request=loras,
                        use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


# ---- greedy parity with peft, one batch mixing two adapters and the base model -------------

@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("max_loras", [2, 1])
def test_mixed_batch_matches_peft(made, mixed, monkeypatch, backend, max_loras):
    prompts, loras, refs, which = mixed
    assert refs[0] != _peft_greedy(made, None, [prompts[0]])[0]  # the adapters change the answers
    monkeypatch.setenv("TOKENLOOM_CPU_LORA", "1" if backend == "cpu" else "0")
    llm = LLM(str(made["base"]), enable_lora=True, max_loras=max_loras, max_lora_rank=8, **ENGINE)
    if llm.llm_engine.backends.lora != backend:
        pytest.skip(f"the {backend} LoRA backend does not run here")
    events = []
    outs = _generate(llm, prompts, loras, events)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert [o.lora_request for o in outs] == loras
    # what each step ran: request id -> adapter (LLM numbers this call's requests 0..n-1)
    kinds = [{which[int(e.request_id)] for e in ev.entries} for ev in events]
    adapters_per_step = [len(k - {None}) for k in kinds]
    assert max(adapters_per_step) == max_loras
    if max_loras == 2:  # both adapters and the base model in one forward pass
        assert {"a1", "a2", None} in kinds
    assert any({"decode", "prefill_chunk"} <= {e.phase for e in ev.entries} for ev in events)
    assert llm.llm_engine.kv.pool.num_free == ENGINE["num_kv_blocks"]


def test_async_scheduling_keeps_each_row_on_its_adapter(made, mixed):
    """With async scheduling a decode step's ids come from the step before, in the
    scheduler's order: the rows are not regrouped then, and still run their own adapters."""
    prompts, loras, refs, which = mixed
    llm = LLM(str(made["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=True, **ENGINE)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, loras)] == refs


# Phi-3 keeps q/k/v and gate/up fused in its checkpoint, so peft adapts them fused; Gemma 2
# runs GeGLU, soft-capped attention and sandwich norms around the same projections.
FAMILIES = {
    "phi3": (lambda: Phi3Config(**TINY, rope_theta=1e4, pad_token_id=0, eos_token_id=2), "phi3",
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gemma2": (lambda: Gemma2Config(**GEMMA2), "gemma", ALL),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_match_peft(tmp_path, family):
    config, chat, targets = FAMILIES[family]
    base = _save_family_checkpoint(config(), tmp_path / "base", chat)
    adapter = _adapter(base, tmp_path / "adapter", 5, r=4, lora_alpha=8, target_modules=targets)
    prompts = _prompts()[:3]
    refs = _greedy(base, adapter, prompts[0::2])
    refs.insert(1, _greedy(base, None, prompts[1:2])[0])
    lr = LoRARequest("a", 1, str(adapter))
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4, **ENGINE)
    outs = _generate(llm, prompts, [lr, None, lr])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert refs[0] != _greedy(base, None, prompts[:1])[0]


def test_kernel_and_torch_deltas_agree():
    """The C++ shrink/expand against PyTorch's matmuls on the same slots, float32 and
    bfloat16, fused (three subs, ragged) and plain linears, rows not in a segment untouched."""
    if cpu_kernels.lora_op(torch.device("cpu"), torch.float32) is None:
        pytest.skip("our CPU kernels do not build here")
    g = torch.Generator().manual_seed(0)
    rows = LoRARows()
    rows.set([(0, 5, 2), (5, 6, 0), (8, 13, 1)])
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for fan_in, subs in ((64, ((0, 64), (64, 96), (96, 128))), (40, ((0, 37), (37, 77))), (136, ((0, 72),))):
            a = torch.randn(3, len(subs) * 8, fan_in, generator=g) / fan_in ** 0.5
            bt = torch.randn(3, 8, subs[-1][1], generator=g)
            x, y = torch.randn(13, fan_in, generator=g), torch.randn(13, subs[-1][1], generator=g)
            ref = y.clone()
            apply_torch(ref, x, a, bt, subs, 8, rows)
            got = y.to(dtype)
            cpu_kernels.apply_lora(got, x.to(dtype), a.to(dtype), bt.to(dtype), subs, 8, rows)
            assert torch.allclose(got.float(), ref, rtol=tol, atol=tol), (dtype, subs)
            assert torch.equal(got[6:8], y[6:8].to(dtype))


def test_beam_search_on_an_adapter_matches_peft(made, lora_llm):
    """Every beam a search forks runs on the search's adapter (transformers' beam search over
    peft's model is the reference)."""
    from test_beam_search import hf_beams

    from tokenloom.sampling_params import BeamSearchParams

    p = _prompts()[1]
    ref, _ = hf_beams(PeftModel.from_pretrained(_hf(made["base"]), str(made["a1"])).eval(), p, 3, 6, 1.0, False, None)
    out = lora_llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True),
                               lora_request=LoRARequest("a1", 1, str(made["a1"])))
    assert [s.output_token_ids for s in out[0].sequences] == ref
    base, _ = hf_beams(_hf(made["base"]), p, 3, 6, 1.0, False, None)
    assert base != ref


# ---- the prefix cache: blocks are shared within an adapter, never across ---------------------

def test_prefix_cache_is_keyed_by_adapter(made, mixed):
    prompts, loras, refs, which = mixed
    a1, a2 = loras[0], loras[1]
    llm = LLM(str(made["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    p = prompts[3]  # 33 tokens: eight full 4-token blocks
    first = _generate(llm, [p], [a1])[0]
    assert first.outputs[0].token_ids == refs[3] and first.num_cached_tokens == 0
    again = _generate(llm, [p], [a1])[0]
    assert again.num_cached_tokens >= 28 and again.outputs[0].token_ids == refs[3]
    other = _generate(llm, [p, p], [a2, None])
    assert [o.num_cached_tokens for o in other] == [0, 0]  # a1's blocks are not theirs
    base_ref, a2_ref = _peft_greedy(made, None, [p])[0], _peft_greedy(made, "a2", [p])[0]
    assert [o.outputs[0].token_ids for o in other] == [a2_ref, base_ref]
    # the keys: the base model's are an engine's without LoRA, every adapter has its own chain
    assert root_key(None, lora_int_id=0) == root_key(None)
    keys = {root_key(None), root_key(None, lora_int_id=1), root_key(None, lora_int_id=2), root_key("1"),
            root_key(None, regime=1), root_key(None, regime=1, lora_int_id=1)}
    assert len(keys) == 6


# ---- the scheduler: at most --max-loras adapters among the running requests -----------------

def _req(rid: str, lora: int) -> Request:
    from tokenloom.sampling_params import SamplingParams as SP

    lr = LoRARequest(f"a{lora}", lora, f"/adapters/{lora}") if lora else None
    return Request(rid, [1, 2, 3], SP(max_tokens=4), 0.0, max_tokens=4, lora_request=lr)


def test_scheduler_passes_over_an_adapter_too_many_and_keeps_the_order():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, max_loras=2),
                      KVCacheManager(64, 4))
    for rid, lora in [("r1", 1), ("r2", 2), ("r3", 3), ("r4", 0), ("r5", 1), ("r6", 3)]:
        sched.add_request(_req(rid, lora))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r1", "r2", "r4", "r5"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r6"]  # passed over, in their order
    finished = []
    while "r1" not in finished or "r5" not in finished:  # adapter 1's requests end: adapter 3 may run
        out = sched.schedule()
        assert len({s.request.lora_int_id for s in out.scheduled} - {0}) <= 2
        finished += [r.request_id for r in sched.update_from_output(out, {s.request_id: 7 for s in out.scheduled})]
    out = sched.schedule()
    assert {"r3", "r6"} <= {s.request_id for s in out.scheduled}


# ---- what is refused, by name --------------------------------------------------------------

def _edited(src: Path, dst: Path, **cfg) -> Path:
    shutil.copytree(src, dst)
    p = dst / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **cfg}))
    return dst


@pytest.fixture(scope="module")
def lora_llm(made):
    return LLM(str(made["base"]), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)


@pytest.mark.parametrize("edit,named", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 16}, "max-lora-rank"),
])
def test_unsupported_adapter_settings_are_refused_by_name(made, lora_llm, tmp_path, edit, named):
    bad = _edited(made["a1"], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=named):
        lora_llm.generate([[5, 6, 7]], lora_request=LoRARequest("bad", 9, str(bad)), use_tqdm=False)


def test_other_adapters_are_refused(made, lora_llm, tmp_path):
    emb = _adapter(made["base"], tmp_path / "emb", 3, r=4, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match="embed_tokens"):
        lora_llm.generate([[5, 6]], lora_request=LoRARequest("emb", 10, str(emb)), use_tqdm=False)
    wide = _save_checkpoint(Qwen2Config(**{**TINY, "hidden_size": 32, "num_attention_heads": 2,
                                            "num_key_value_heads": 1}, rope_theta=1e6), tmp_path / "other")
    other = _adapter(wide, tmp_path / "other-a", 4, r=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="another base model"):
        lora_llm.generate([[5, 6]], lora_request=LoRARequest("o", 11, str(other)), use_tqdm=False)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora_llm.generate([[5, 6]], lora_request=LoRARequest("none", 12, str(tmp_path / "nothing")), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is already"):
        lora_llm.generate([[5]] * 2, lora_request=[LoRARequest("a1", 1, str(made["a1"])),
                                                   LoRARequest("a2", 1, str(made["a2"]))], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(made["a1"]))


def test_engine_settings_are_checked(made):
    for kw, named in (({"max_loras": 0}, "--max-loras"), ({"max_lora_rank": 0}, "--max-lora-rank")):
        with pytest.raises(ValueError, match=named):
            LoRAConfig.from_args(EngineArgs(enable_lora=True, **kw))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(made["base"]), **ENGINE).generate([[5]], lora_request=LoRARequest("a1", 1, str(made["a1"])),
                                                  use_tqdm=False)
    with pytest.raises(ValueError, match="--compile"):
        LLM(str(made["base"]), enable_lora=True, compile=True, **ENGINE)


# ---- the server -----------------------------------------------------------------------------

KEY = "lora-key"


@pytest.fixture(scope="module")
def server(made):
    srv = ThreadedServer([str(made["base"]), "--port", str(free_port()), "--served-model-name", "tiny",
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", f"a1={made['a1']}", "--api-key", KEY, "--log-level", "critical",
                          "--disable-access-log", *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]]).start()
    yield srv
    srv.stop()


def _post(srv, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.base_url + route, json=body, headers=headers, timeout=60)


def _error(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_server_lists_serves_loads_and_unloads_adapters(server, made, mixed, lora_llm, tmp_path):
    prompts, loras, refs, which = mixed
    h = {"Authorization": f"Bearer {KEY}"}
    cards = {c["id"]: c for c in httpx.get(server.base_url + "/v1/models", headers=h).json()["data"]}
    assert set(cards) == {"tiny", "a1"} and cards["a1"]["parent"] == "tiny" and cards["tiny"]["parent"] is None
    assert cards["a1"]["root"] == str(made["a1"])
    # what each prompt says offline (greedy tokens: peft's), as text
    offline = _generate(lora_llm, prompts[:3], loras[:3])
    assert [o.outputs[0].token_ids for o in offline] == refs[:3]

    def complete(model: str, i: int) -> str:
        r = _post(server, "/v1/completions", {"model": model, "prompt": prompts[i], "max_tokens": N,
                                              "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return r.json()["choices"][0]["text"]

    # the key guards loading and unloading like every /v1 route
    body = {"lora_name": "a2", "lora_path": str(made["a2"])}
    assert _post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert _post(server, "/v1/load_lora_adapter", body, key="wrong").status_code == 401
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "a2" in r.text
    assert httpx.get(server.base_url + "/v1/models/a2", headers=h).json()["parent"] == "tiny"
    assert [complete("a1", 0), complete("a2", 1), complete("tiny", 2)] == [o.outputs[0].text for o in offline]
    assert _post(server, "/tokenize", {"model": "a2", "prompt": "hello"}).status_code == 200

    # bad input: 400/404/409 naming the field
    _error(_post(server, "/v1/load_lora_adapter", body), 409, "lora_name")
    _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(made["a2"])}), 409,
           "lora_name")
    _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": str(made["a2"])}), 400, "lora_name")
    _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 5}), 400, "lora_path")
    _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "no")}), 404,
           "lora_path")
    dora = _edited(made["a1"], tmp_path / "dora", use_dora=True)
    assert "use_dora" in _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(dora)}),
                                400, "lora_path")
    _error(_post(server, "/v1/unload_lora_adapter", {}), 400, "lora_name")

    # unloading: the name is gone for new requests
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 200
    _error(_post(server, "/v1/completions", {"model": "a2", "prompt": "hi", "max_tokens": 2}), 404, "model")
    _error(_post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}), 404, "lora_name")
    assert set(c["id"] for c in httpx.get(server.base_url + "/v1/models", headers=h).json()["data"]) == {"tiny", "a1"}
    # loaded again under the same name: a fresh id, and it answers as before
    assert _post(server, "/v1/load_lora_adapter", body).status_code == 200
    assert complete("a2", 1) == offline[1].outputs[0].text


def test_openapi_document_describes_the_adapter_routes(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    for route, schema, statuses in (("/v1/load_lora_adapter", "LoadLoRAAdapterRequest", {"400", "401", "404", "409"}),
                                    ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest", {"400", "401", "404"})):
        op = doc["paths"][route]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(schema)
        assert statuses <= set(op["responses"]) and "422" not in op["responses"]
    assert doc["components"]["schemas"]["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]


def test_serve_flags_are_checked(made):
    from tokenloom.entrypoints.openai.lora_models import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    for bad in (["noequals"], ["=/x"], ["a=/x", "a=/y"], ["{nope"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    with pytest.raises(ValueError, match="--enable-lora"):
        ThreadedServer([str(made["base"]), "--port", str(free_port()), "--lora-modules", f"a1={made['a1']}"])
