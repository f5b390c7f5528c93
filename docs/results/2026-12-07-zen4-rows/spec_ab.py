"""Same-process A/B: plain decode, speculation with verifying steps eager (before), replayed (now)."""
import json, statistics, sys
sys.path.insert(0, "scripts")
from bench_spec_decode import copy_prompts, edit_prompts, run
from tokenloom import LLM, SamplingParams
M = "/tmp/tokenloom-copy-model"
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 1024}
kw = dict(max_model_len=512, seed=0)
eng = {"off": LLM(M, **kw), "eager": LLM(M, speculative_config=spec, **kw), "replayed": LLM(M, speculative_config=spec, **kw)}
r = eng["eager"].llm_engine.runner
orig = r._graph_decodes
r._graph_decodes = lambda out, drafts=True: orig(out, drafts=False)
tok = eng["off"].get_tokenizer()
sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
res = {}
for wl, prompts in (("copy", copy_prompts(tok, 4, 160, 0)), ("edit", edit_prompts(tok, 4, 160, 0))):
    for e in eng.values(): run(e, prompts[:1], sp, 1)
    rates = {k: [] for k in eng}; outs = {}
    for rnd in range(9):
        names = list(eng) if rnd % 2 == 0 else list(eng)[::-1]
        for n in names:
            rate, _, o = run(eng[n], prompts, sp, 1); rates[n].append(rate); outs[n] = o
        assert outs["off"] == outs["eager"] == outs["replayed"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    res[wl] = {"tok_s": med, "rounds": rates}
    print(wl, {k: round(v) for k, v in med.items()}, "eager x%.2f" % (med["eager"] / med["off"]), "replayed x%.2f" % (med["replayed"] / med["off"]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
