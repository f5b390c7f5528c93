"""Embeddings (`LLM(runner="pooling").embed`, `/v1/embeddings`) against sentence-transformers.

The checkpoints are sentence-transformers' own: a tiny random-weight decoder wrapped as
`SentenceTransformer(Transformer, Pooling(mode), Normalize)` and saved by it (tests/st_models.py).
Our vectors must equal `SentenceTransformer.encode` on every pooling mode -- with prompts
chunked over many steps (a 16-token budget, 4-token blocks) and under preemption -- through
the offline API and through a real server driven by the official `openai` client (which asks
for base64 by default and decodes it), for string, list and token-id inputs; every bad field
is a 400 naming it, and the KV cache is empty afterwards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from server_fixtures import ThreadedServer, wait_until
from st_models import make_st_model
from tokenloom import LLM
from tokenloom.bench.launcher import free_port
from tokenloom.pooling_params import PoolingParams

# forced chunking: prompts of 40-100 tokens go through in 16-token steps, in 4-token blocks
CHUNKED = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=96)
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 4, "a",
         "def function(x, y):\n    return x * y + 1  # " * 4]
ATOL = 2e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from tokenloom.model.tools.make_model import make_model

    return make_model("tiny-llama", tmp_path_factory.mktemp("emb") / "tiny")


@pytest.fixture(scope="module")
def st_dirs(base: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("st")
    return {mode: make_st_model(base, root / mode, mode) for mode in ("lasttoken", "mean", "cls")}


def _st(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def _free(llm: LLM) -> bool:
    kv = llm.llm_engine.kv
    return kv.pool.num_free == kv.num_blocks


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls"])
def test_llm_embed_matches_sentence_transformers(st_dirs, mode):
    path = st_dirs[mode]
    ref = _st(path).encode(TEXTS, convert_to_numpy=True)
    events = []
    llm = LLM(str(path), observers=[events.append], **CHUNKED)  # runner auto: a base model pools
    assert llm.llm_engine.runner_type == "pooling"
    assert "sentence-transformers" in llm.llm_engine.summary()
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=ATOL)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # the long prompts really were computed in chunks, and each embedding freed its blocks
    assert any(e.phase == "prefill_chunk" for ev in events for e in ev.entries)
    assert all(ev.num_batched_tokens <= 16 for ev in events)
    assert _free(llm)
    # token ids give the same vectors as the text they encode
    ids = llm.get_tokenizer().encode(TEXTS[1])
    (by_ids,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    np.testing.assert_allclose(by_ids.outputs.embedding, ref[1], atol=ATOL)
    assert by_ids.prompt_token_ids == ids


def test_mean_pooling_restarts_after_its_blocks_are_taken(st_dirs):
    """A request paused part-way through its prompt loses its KV blocks to another (too few
    for both) and recomputes its prompt when resumed: its pooled sum starts over, and both
    vectors stay exact."""
    path = st_dirs["mean"]
    texts = [f"{i} " + "some longer text to embed, in many chunks " * 3 for i in range(2)]
    ref = _st(path).encode(texts, convert_to_numpy=True)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=16)
    engine, done = llm.llm_engine, {}

    def run() -> None:
        while engine.has_schedulable_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)

    engine.add_request("a", texts[0], PoolingParams())
    engine.step()  # a's first chunk: 16 of its ~60 tokens summed
    assert engine.pause_request("a")
    engine.add_request("b", texts[1], PoolingParams())
    run()  # b needs every block: a's are taken back
    assert engine.scheduler.num_preemptions == 1
    engine.resume_request("a")
    run()
    got = np.array([done["a"].outputs.embedding, done["b"].outputs.embedding])
    np.testing.assert_allclose(got, ref, atol=ATOL)
    assert _free(llm)


def test_dimensions_only_for_matryoshka_models(base, st_dirs, tmp_path):
    mat = make_st_model(base, tmp_path / "mat", "mean", config_extra={"matryoshka_dimensions": [16, 32]})
    full = _st(mat).encode(TEXTS[:2], convert_to_numpy=True)
    llm = LLM(str(mat), **CHUNKED)
    outs = llm.embed(TEXTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
    short = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)  # cut, then unit length again
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in outs]), short, atol=ATOL)
    (bad,) = llm.embed(TEXTS[:1], PoolingParams(dimensions=20), use_tqdm=False)
    assert bad.error is not None and bad.error.startswith("dimensions:") and "[16, 32]" in bad.error
    plain = LLM(str(st_dirs["lasttoken"]), **CHUNKED)
    (refused,) = plain.embed(TEXTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    assert refused.error is not None and "matryoshka" in refused.error
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_decoder_without_st_files_pools_last_token_normalised(base):
    """A causal LM with no sentence-transformers files, run with runner="pooling" (and vLLM's
    older task="embed"): its last token's final hidden state, unit length -- checked against
    transformers' base model."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(base, dtype=torch.float32).eval()
    for kw in (dict(runner="pooling"), dict(task="embed")):
        llm = LLM(str(base), **kw, **CHUNKED)
        assert "last-token pooling, normalised (default: no modules.json)" in llm.llm_engine.summary()
        ids = llm.get_tokenizer().encode(TEXTS[1])
        (out,) = llm.embed([ids], use_tqdm=False)
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        np.testing.assert_allclose(out.outputs.embedding, torch.nn.functional.normalize(h, dim=0).numpy(),
                                   atol=ATOL)


def test_refusals_name_the_setting(base, st_dirs, tmp_path):
    st = st_dirs["lasttoken"]
    with pytest.raises(ValueError, match="runner pooling"):
        LLM(str(st), runner="generate", **CHUNKED)  # a base model cannot generate
    with pytest.raises(ValueError, match="--task embed contradicts --runner generate"):
        LLM(str(base), runner="generate", task="embed", **CHUNKED)
    pooled = LLM(str(st), **CHUNKED)
    with pytest.raises(ValueError, match="LLM.generate needs runner='generate'"):
        pooled.generate(["hi"])
    with pytest.raises(ValueError, match="LLM.embed needs runner='pooling'"):
        LLM(str(base), **CHUNKED).embed(["hi"])
    (too_long,) = pooled.embed([list(range(5, 134))], use_tqdm=False)  # 129 tokens > max_model_len 128
    assert too_long.error is not None and "max_model_len" in too_long.error
    (exact,) = pooled.embed([list(range(5, 133))], use_tqdm=False)  # 128 fit: an embedding generates nothing
    assert exact.error is None and len(exact.outputs.embedding) == 64
    # a module we do not implement is refused by name, not pooled some other way
    dense = tmp_path / "dense"
    shutil.copytree(st, dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        LLM(str(dense), **CHUNKED)
    maxpool = tmp_path / "maxpool"
    shutil.copytree(st, maxpool)
    (maxpool / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode 'max' is not supported"):
        LLM(str(maxpool), **CHUNKED)


# ---- the server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(st_dirs):
    srv = ThreadedServer([str(st_dirs["mean"]), "--runner", "pooling", "--port", str(free_port()),
                          "--max-model-len", "128", "--num-kv-blocks", "96", "--block-size", "4",
                          "--max-num-batched-tokens", "16", "--served-model-name", "emb", "--log-level", "warning",
                          "--disable-access-log"]).start()
    yield srv
    srv.stop()


def _idle(srv) -> bool:
    snap = srv.engine.snapshot()
    return snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_cache_usage == 0


def test_server_embeddings_match_sentence_transformers(server, st_dirs):
    ref = _st(st_dirs["mean"]).encode(TEXTS, convert_to_numpy=True)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    # the openai client asks for base64 unless told otherwise, and decodes it
    r = client.embeddings.create(model="emb", input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), ref, atol=ATOL)
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    tok = server.engine.tokenizer
    ntok = sum(len(tok.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == ntok and r.model == "emb"
    r = client.embeddings.create(model="emb", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, ref[1], atol=ATOL)
    raw = httpx.post(server.base_url + "/v1/embeddings",
                     json={"input": TEXTS[:2], "encoding_format": "base64"}).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert isinstance(raw["data"][0]["embedding"], str)
    ids = [tok.encode(t) for t in TEXTS[:2]]
    r = client.embeddings.create(model="emb", input=ids[1], encoding_format="float")  # one token-id list
    np.testing.assert_allclose(r.data[0].embedding, ref[1], atol=ATOL)
    r = client.embeddings.create(model="emb", input=ids, encoding_format="float")  # a list of them
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), ref[:2], atol=ATOL)
    assert wait_until(lambda: _idle(server), 10)


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": "the quick brown fox jumps " * 40}, "input"),
    ({"input": list(range(5, 134))}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": 5}, "input"),
])
def test_server_bad_fields_are_400s_naming_them(server, body, param):
    r = httpx.post(server.base_url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_server_runs_one_kind_of_engine(server):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "other", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_route"
    assert "--runner generate" in r.json()["error"]["message"]
    paths = httpx.get(server.base_url + "/openapi.json").json()["paths"]
    assert "/v1/embeddings" in paths and "/v1/completions" not in paths
    assert wait_until(lambda: _idle(server), 10)
