"""`tokenloom trace`: the seed's walk-through recorded from a real run (tiny random model, greedy).

Checked against the seed: prefill fills the KV cache with the prompt, every decode step
feeds one token and grows the cache by exactly one, the sampled tokens are the engine's
greedy output; under small budgets the trace shows chunked prefill and a preemption with
batch compositions that respect the step budget; the HTML/PNG/JSON outputs are real.
"""

from __future__ import annotations

import io
import json
from html.parser import HTMLParser

import pytest
from rich.console import Console

from tokenloom import LLM, SamplingParams
from tokenloom.entrypoints.cli import main as cli_main
from tokenloom.model.tools.make_model import make_model
from tokenloom.trace.html import render_html
from tokenloom.trace.png import render_png
from tokenloom.trace.recorder import Trace, run_trace
from tokenloom.trace.text import MAPPING_NOTE, SEED_PROMPT, render_text
from tokenloom.trace.timeline import Timeline
from tokenloom.trace.tokens import TokenPiece, complete_text, group_by_character, label

GREEDY = dict(temperature=0.0)
# small budgets that force chunking (16 tokens a step) and preemption (16 blocks of 4 tokens)
TIGHT = dict(max_model_len=64, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=3)
PROMPTS = ["hello world this is a test of things", "def foo(x): return x+1", SEED_PROMPT, "The quick brown fox"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model("tiny-qwen2", tmp_path_factory.mktemp("trace-model") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def seed_run(model_dir):
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=32)
    trace = run_trace(llm, [SEED_PROMPT], SamplingParams(max_tokens=8, **GREEDY))
    return llm, trace


@pytest.fixture(scope="module")
def tight_trace(model_dir) -> Trace:
    llm = LLM(model_dir, **TIGHT)
    return run_trace(llm, PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))


def console_text(trace: Trace, **kw) -> str:
    buf = io.StringIO()
    render_text(trace, Console(file=buf, width=160, color_system=None), **kw)
    return buf.getvalue()


# ---- the seed's single prompt -------------------------------------------------------
def test_seed_prompt_prefill_then_one_token_per_decode_step(model_dir, seed_run):
    llm, trace = seed_run
    prompt_ids = llm.get_tokenizer().encode(SEED_PROMPT, add_special_tokens=True)
    assert trace.requests[0].prompt_token_ids == prompt_ids
    entries = [en for e in trace.events for en in e.entries]
    assert all(len(e.entries) == 1 for e in trace.events)

    first = entries[0]  # prefill: the whole prompt into the KV cache, and the first sample
    assert first.phase == "prefill" and first.token_ids == prompt_ids
    assert (first.kv_len_before, first.kv_len_after) == (0, len(prompt_ids))
    assert first.sampled_token_id is not None

    prev = first
    for en in entries[1:]:  # decode: feed the token sampled last step, KV grows by exactly one
        assert en.phase == "decode" and en.num_tokens == 1
        assert en.token_ids == [prev.sampled_token_id]
        assert en.kv_len_before == prev.kv_len_after
        assert en.kv_len_after == en.kv_len_before + 1
        prev = en
    assert prev.finished and prev.finish_reason in ("length", "stop")

    sampled = [en.sampled_token_id for en in entries]
    assert sampled == trace.requests[0].samples[0].output_token_ids
    # the observer changes nothing: a fresh engine without it generates the same greedy tokens
    ref = LLM(model_dir, max_model_len=128, num_kv_blocks=32).generate(
        [SEED_PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert sampled == ref[0].outputs[0].token_ids


def test_seed_prompt_console_walkthrough(seed_run):
    _, trace = seed_run
    out = console_text(trace)
    assert SEED_PROMPT in out
    assert f"{len(trace.requests[0].prompt_token_ids)} tokens" in out
    for ch in SEED_PROMPT:  # every character of the prompt is shown with the tokens that spell it
        assert f"{ch}:" in out
    n = len(trace.events)
    assert "Prefill" in out and "+ Decode step 1" in out and f"Decode step {n}" in out
    p = len(trace.requests[0].prompt_token_ids)
    assert f"0→{p}" in out and f"{p}→{p + 1}" in out  # KV cache before → after
    assert "first sample" in out and " ".join(MAPPING_NOTE.split()[:8]) in " ".join(out.split())
    for word in ("TTFT", "TPOT", "tokens/s", trace.requests[0].samples[0].finish_reason):
        assert word in out
    assert "Continuous batching" not in out  # one request: no batch picture unless asked
    assert "step 1: A(prefill" in console_text(trace, batches=True)


def test_token_strings_for_partial_utf8(seed_run):
    _, trace = seed_run
    ids = trace.requests[0].prompt_token_ids
    groups = group_by_character(trace.tokens, ids)
    assert "".join(g.text for g in groups) == SEED_PROMPT
    assert all(len(g.text) == 1 for g in groups)  # byte tokens regrouped into whole characters
    bei = groups[0]
    assert b"".join(trace.tokens[t].raw for t in bei.ids) == "北".encode()
    if len(bei.ids) > 1:  # this tiny vocabulary spells 北 as single bytes: shown as hex, not U+FFFD
        assert label(trace.tokens[bei.ids[0]]) == "<e5>"
    assert complete_text(trace.tokens, ids) == SEED_PROMPT


def test_token_labels_unit():
    table = {1: TokenPiece("\ufffd", b"\xe4\xb8"), 2: TokenPiece("\ufffd", b"\xad"), 3: TokenPiece(" the", b" the"),
             4: TokenPiece("<|endoftext|>", None, special=True), 5: TokenPiece("a\ufffd", b"a\xe4"),
             6: TokenPiece("\n", b"\n")}
    assert label(table[1]) == "<e4 b8>"
    assert label(table[3]) == '" the"'
    assert label(table[4]) == "<|endoftext|>"
    assert label(table[5]) == '"a"<e4>'
    assert label(table[6]) == '"\\n"'
    assert complete_text(table, [3, 1], final=False) == " the"  # partial character held back
    assert complete_text(table, [3, 1, 2, 4]) == " the中"  # completed; special token left out
    assert [g.text for g in group_by_character(table, [3, 1, 2])] == [" the", "中"]


# ---- several prompts under small budgets ---------------------------------------------
def test_tight_budgets_chunk_and_preempt(tight_trace):
    trace = tight_trace
    events = trace.events
    assert [e.step for e in events] == list(range(1, len(events) + 1))
    for e in events:  # every step respects the seed's two knobs and the KV pool
        assert sum(en.num_tokens for en in e.entries) == e.num_batched_tokens <= TIGHT["max_num_batched_tokens"]
        assert len(e.entries) <= TIGHT["max_num_seqs"]
        assert 0 <= e.kv_blocks_used <= e.kv_blocks_total == TIGHT["num_kv_blocks"]
        assert len({en.request_id for en in e.entries}) == len(e.entries)
        for en in e.entries:
            assert en.kv_len_after == en.kv_len_before + en.num_tokens
            if en.phase == "decode":
                assert en.num_tokens == 1 and en.sampled_token_id is not None
    chunks = [en for e in events for en in e.entries if en.phase == "prefill_chunk"]
    assert any(en.sampled_token_id is None for en in chunks), "a prompt longer than the budget is chunked"

    preempted = [(i, rid) for i, e in enumerate(events) for rid in e.preempted]
    assert preempted, "16 blocks of 4 tokens cannot hold 3 running requests: someone is preempted"
    for i, rid in preempted:  # the victim comes back later, recomputes, and finishes
        later = [en for e in events[i + 1:] for en in e.entries if en.request_id == rid]
        assert later and later[0].phase != "decode" and later[-1].finished
        assert rid not in {en.request_id for en in events[i].entries}

    # the events agree with LLM.generate's outputs, token for token
    for r in trace.requests:
        s = r.samples[0]
        got = [en.sampled_token_id for e in events for en in e.entries
               if en.request_id == s.request_id and en.sampled_token_id is not None]
        assert got == s.output_token_ids and len(got) == 10 and s.finish_reason == "length"
    assert sum(r.num_preemptions for r in trace.requests) == len(preempted)


def _first_step(trace: Trace) -> str:
    """What step 1 must show under TIGHT's 16-token budget: A's whole prompt, then B's first
    chunk from what is left (token counts from the tokenizer, which differ across versions)."""
    na, nb = (len(r.prompt_token_ids) for r in trace.requests[:2])
    budget = TIGHT["max_num_batched_tokens"]
    assert na < budget < na + nb  # A fits, B is chunked: the line this checks
    return f"A(prefill {na}/{na}) B(prefill {budget - na}/{nb})"


def test_batch_composition_lines(tight_trace):
    trace = tight_trace
    tl = Timeline(trace)
    labels = {s.request_id: s.label for s in trace.samples()}
    assert sorted(labels.values()) == ["A", "B", "C", "D"]
    for i, e in enumerate(tl.events):
        line = tl.batch_line(i)
        assert [m for m, _ in line.members] == [labels[en.request_id] for en in e.entries]
        for (m, note), en in zip(line.members, e.entries):
            assert (note == "") == (en.phase == "decode")
            if en.phase != "decode":
                assert note.endswith(f"{en.kv_len_after}/{tl.cells[en.request_id][i].target}")
        assert line.preempted == [labels[r] for r in e.preempted]
        for rid in e.preempted:
            assert tl.cells[rid][i].state == "preempted"
    out = console_text(trace)
    assert "Continuous batching" in out
    first = next(l for l in out.splitlines() if l.startswith("step 1:") or l.startswith("step  1:"))
    assert _first_step(trace) in first and "waiting C D" in first
    assert any("preempted" in l and l.lstrip().startswith("step") for l in out.splitlines())
    assert "re-prefill" in out and "Re-prefill" in out  # the recompute after preemption is named
    # every cell of the grid: requests that are neither in the batch nor done are waiting/preempted/stalled
    for rid in tl.rows:
        assert len(tl.cells[rid]) == len(tl.events)


# ---- files ---------------------------------------------------------------------------
class _Checker(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "wbr", "area", "base", "embed", "track"}
    SVG_LEAVES = {"line", "polyline", "circle", "rect", "path"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: dict[str, int] = {}
        self.ids: set[str] = set()
        self.titled_cells = 0
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "td" and a.get("title"):
            self.titled_cells += 1
        for k in ("src", "href", "xlink:href", "action"):
            if k in a:
                self.urls.append(a[k])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for k in ("src", "href", "xlink:href"):
            if k in dict(attrs):
                self.urls.append(dict(attrs)[k])

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()


def test_html_is_self_contained_timeline(tight_trace, tmp_path):
    trace = tight_trace
    page = render_html(trace)
    (tmp_path / "t.html").write_text(page, encoding="utf-8")
    c = _Checker()
    c.feed(page)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert page.lstrip().lower().startswith("<!doctype html>")
    assert "timeline" in c.ids and "kvchart" in c.ids and c.tags.get("svg") == 1
    assert c.tags.get("link") is None and c.urls == []
    for scheme in ("http://", "https://", "//cdn", "url("):
        assert scheme not in page
    tl = Timeline(trace)
    assert c.titled_cells >= len(tl.rows) * len(tl.events)  # every grid cell hovers with its tokens
    # the preempted cell and a chunk's token count are in the grid; token text is in the hover
    assert 'class="preempted"' in page and 'class="prefill_chunk"' in page
    first_sampled = trace.events[0].entries[0].sampled_token_id
    assert f"sampled  {first_sampled} " in page
    assert SEED_PROMPT in page


def test_png_is_written(tight_trace, seed_run, tmp_path):
    import matplotlib.image as mpimg

    for name, trace in (("tight.png", tight_trace), ("seed.png", seed_run[1])):
        path = render_png(trace, tmp_path / name)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        img = mpimg.imread(path)
        assert img.shape[0] > 300 and img.shape[1] > 800


def test_json_round_trip(tight_trace, tmp_path):
    d = tight_trace.to_dict()
    text = json.dumps(d, ensure_ascii=False)
    back = Trace.from_dict(json.loads(text))
    assert [e.to_dict() for e in back.events] == d["steps"]
    assert back.tokens == tight_trace.tokens
    assert [r.prompt_token_ids for r in back.requests] == [r.prompt_token_ids for r in tight_trace.requests]
    assert d["requests"][0]["ttft"] == pytest.approx(tight_trace.requests[0].ttft)
    assert console_text(back) == console_text(tight_trace)


# ---- the command line ----------------------------------------------------------------
def test_cli_trace(model_dir, tmp_path, capsys):
    html, png, js = tmp_path / "t.html", tmp_path / "t.png", tmp_path / "t.json"
    rc = cli_main(["trace", "--model", model_dir, "--max-tokens", "4", "--max-model-len", "128",
                   "--num-kv-blocks", "32", "--html", str(html), "--png", str(png), "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert SEED_PROMPT in out and "Decode step 4" in out and "TTFT" in out
    assert html.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    d = json.loads(js.read_text(encoding="utf-8"))
    assert d["format"] == "tokenloom-trace" and len(d["steps"]) == 4
    assert d["requests"][0]["prompt"] == SEED_PROMPT and d["settings"]["sampling"]["temperature"] == 0.0

    rc = cli_main(["trace", "--load", str(js), "--no-steps"])
    assert rc == 0
    again = capsys.readouterr().out
    assert "TTFT" in again and "Decode step" not in again


def test_cli_trace_several_prompts(model_dir, tight_trace, capsys):
    args = ["trace", "--model", model_dir, "--max-tokens", "3", "--ignore-eos", "--no-steps"]
    for k, v in TIGHT.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    assert cli_main(args + PROMPTS[:3]) == 0
    out = capsys.readouterr().out
    assert "step 1: " + _first_step(tight_trace) in out
