"""The seed's continuous-batching picture as one self-contained HTML page.

    step1: A B C D
    step2: A B C
    step3: A B

becomes a grid: a row per request, a column per step, each cell coloured by what the
request did in that step (waiting, prefill chunk with its token count, decode,
preempted, finished).  Under the grid, aligned to the same columns: KV blocks in use,
tokens in the batch, step time.  An inline SVG draws each request's KV length over the
steps (the seed's "KV Cache grows by one per decode step"; a preemption drops it to 0).
Hovering a cell shows the tokens fed and sampled.

No network: CSS, JS and SVG are inline, nothing is fetched.
"""

from __future__ import annotations

import datetime as _dt
from html import escape

from tokenloom.trace.recorder import Trace
from tokenloom.trace.text import MAPPING_NOTE, SEED_PROMPT, shorten
from tokenloom.trace.timeline import STATE_NAMES, Cell, Timeline
from tokenloom.trace.tokens import complete_text, group_by_character, label, visible

# One colour per request (the seed's A B C D), also used by the SVG and the PNG.
REQUEST_COLORS = ["#0e7490", "#a21caf", "#15803d", "#b45309", "#1d4ed8", "#b91c1c", "#0f766e", "#7c3aed"]

_CSS = """
:root { --fg:#1f2937; --mute:#6b7280; --line:#e5e7eb; --bg:#ffffff; --panel:#f9fafb;
  --prefill:#2563eb; --chunk:#93c5fd; --recompute:#a78bfa; --decode:#22c55e; --finish:#15803d;
  --preempt:#ef4444; --wait:#eef0f3; --stall:#fcd34d; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "PingFang SC", "Noto Sans CJK SC", sans-serif;
  color: var(--fg); background: var(--bg); margin: 0; padding: 24px 32px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.meta { color: var(--mute); margin: 0; } code, .mono { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; }
.note { background: var(--panel); border-left: 3px solid var(--prefill); padding: 8px 12px; max-width: 980px; color: #374151; }
table.req { border-collapse: collapse; } table.req td, table.req th { padding: 3px 10px; border-bottom: 1px solid var(--line);
  text-align: left; vertical-align: top; } table.req th { color: var(--mute); font-weight: 600; }
table.req td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.lbl { display: inline-block; min-width: 22px; padding: 0 5px; border-radius: 4px; color: #fff; font-weight: 700;
  text-align: center; }
.scroll { overflow-x: auto; padding-bottom: 6px; }
table.tl { border-collapse: separate; border-spacing: 2px; font-size: 11px; }
table.tl th { font-weight: 600; color: var(--mute); position: sticky; left: 0; background: var(--bg); text-align: right;
  padding: 0 8px 0 0; white-space: nowrap; z-index: 1; }
table.tl thead th { text-align: center; padding: 0; position: static; font-weight: 500; min-width: 26px; }
table.tl td { min-width: 28px; height: 26px; text-align: center; border-radius: 3px; padding: 0 2px; color: #fff;
  font-variant-numeric: tabular-nums; cursor: default; }
td.waiting { background: var(--wait); } td.done { background: transparent; }
table.tl td.prefill { background: var(--prefill); }
table.tl td.prefill_chunk { background: var(--chunk); color: #1e3a8a; font-weight: 600; }
table.tl td.recompute { background: var(--recompute); color: #2e1065; font-weight: 600; }
table.tl td.decode { background: var(--decode); } table.tl td.fin { background: var(--finish); color: #fff; font-weight: 700; }
table.tl td.preempted { background: var(--preempt); font-weight: 700; }
table.tl td.stalled { background: var(--stall); color: #78350f; }
table.tl tbody td:hover { outline: 2px solid #111827; outline-offset: -1px; }
tr.sep td, tr.sep th { height: 8px; }
tr.bars td { height: 56px; vertical-align: bottom; padding: 0; background: var(--panel); border-radius: 2px; }
tr.bars .bar { width: 100%; border-radius: 2px 2px 0 0; }
tr.kv .bar { background: #f59e0b; } tr.tok .bar { background: #6366f1; } tr.ms .bar { background: #94a3b8; }
tr.nums td { color: var(--mute); height: 16px; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; margin: 4px 0 10px; color: #374151; }
.legend span i { display: inline-block; width: 14px; height: 14px; border-radius: 3px; vertical-align: -2px; margin-right: 5px; }
.chips { display: flex; flex-wrap: wrap; gap: 4px; margin: 6px 0 14px; }
.grp { display: inline-flex; flex-direction: column; align-items: center; border: 1px solid var(--line); border-radius: 5px;
  padding: 2px 6px; background: var(--panel); }
.grp .ch { font-size: 15px; font-weight: 600; white-space: pre; } .grp .ids { font-size: 10px; color: var(--mute); }
table.steps { border-collapse: collapse; font-size: 12.5px; } table.steps td, table.steps th { padding: 2px 10px;
  border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; } table.steps th { color: var(--mute); }
table.steps tr.first td { border-top: 1px solid #cbd5e1; } td.r { text-align: right; font-variant-numeric: tabular-nums; }
.ph-prefill { color: var(--prefill); } .ph-prefill_chunk { color: #1d4ed8; } .ph-decode { color: #15803d; }
.ph-recompute { color: #6d28d9; } .pre { color: var(--preempt); font-weight: 600; }
#tip { position: fixed; pointer-events: none; background: #111827; color: #f9fafb; padding: 6px 9px; border-radius: 5px;
  font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; display: none; z-index: 10; max-width: 640px;
  box-shadow: 0 4px 14px rgba(0,0,0,.25); }
svg text { font: 11px system-ui, sans-serif; fill: #6b7280; }
"""

# Moves each title into a faster, styled tooltip; without JS the title still works.
_JS = """
(function () {
  var tip = document.getElementById('tip');
  document.querySelectorAll('[title]').forEach(function (el) {
    el.setAttribute('data-tip', el.getAttribute('title')); el.removeAttribute('title');
  });
  document.addEventListener('mousemove', function (ev) {
    var el = ev.target.closest ? ev.target.closest('[data-tip]') : null;
    if (!el) { tip.style.display = 'none'; return; }
    tip.textContent = el.getAttribute('data-tip'); tip.style.display = 'block';
    var x = ev.clientX + 14, y = ev.clientY + 14, r = tip.getBoundingClientRect();
    if (x + r.width > window.innerWidth - 8) x = ev.clientX - r.width - 14;
    if (y + r.height > window.innerHeight - 8) y = ev.clientY - r.height - 14;
    x = Math.max(8, x); y = Math.max(8, y);
    tip.style.left = x + 'px'; tip.style.top = y + 'px';
  });
})();
"""


def _color(i: int) -> str:
    return REQUEST_COLORS[i % len(REQUEST_COLORS)]


def _ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:.1f} ms"


def _q(s: str) -> str:
    return escape(s, quote=True)


def cell_tip(trace: Trace, tl: Timeline, rid: str, i: int, out_so_far: list[int]) -> str:
    """Hover text of one cell: what the request did in this step, in tokens."""
    cell = tl.cells[rid][i]
    e = tl.events[i]
    head = f"step {e.step} · {tl.labels[rid]} · "
    en = cell.entry
    if en is None:
        return head + STATE_NAMES[cell.state] + (f"\n{cell.num_output} tokens generated so far" if cell.num_output else "")
    lines = [head + _phase_words(cell)]
    if en.num_tokens == 1:
        lines.append(f"fed      {en.token_ids[0]} {label(trace.tokens.get(en.token_ids[0]))}")
    else:
        lines.append(f"fed      {en.num_tokens} tokens \"{shorten(visible(complete_text(trace.tokens, en.token_ids)), 48)}\"")
    lines.append(f"KV cache {en.kv_len_before} → {en.kv_len_after}")
    if en.sampled_token_id is not None:
        lines.append(f"sampled  {en.sampled_token_id} {label(trace.tokens.get(en.sampled_token_id))}")
    if en.draft_token_ids:
        lines.append(f"drafts   {len(en.draft_token_ids)} fed, {en.num_accepted_tokens} accepted")
        lines.append(f"text     \"{shorten(visible(_tail_text(trace, out_so_far, en.finished)), 48, keep_end=True)}\"")
    else:
        lines.append("sampled  – (prompt not fully read yet)")
    if en.finished:
        lines.append(f"finished ({en.finish_reason})")
    lines.append(f"step time {_ms(e.duration)}")
    return "\n".join(lines)


def _tail_text(trace: Trace, ids: list[int], final: bool, window: int = 48) -> str:
    """The end of a request's text so far; only the last tokens are decoded, so a page with
    thousands of cells stays linear in size and time."""
    if len(ids) <= window:
        return complete_text(trace.tokens, ids, final=final)
    # the window may start inside a character: drop the orphaned bytes' replacement marks
    return "…" + complete_text(trace.tokens, ids[-window:], final=final).lstrip("\ufffd")


def _phase_words(cell: Cell) -> str:
    en = cell.entry
    assert en is not None
    if en.phase == "decode":
        return f"decode step {cell.num_output} (1 token)"
    word = "re-prefill after preemption" if cell.recompute else STATE_NAMES[en.phase]
    s = f"{word}: {en.num_tokens} token{'s' if en.num_tokens != 1 else ''}, {en.kv_len_after}/{cell.target} done"
    if cell.completes_prefill:
        s += f" + samples token {cell.num_output} (decode step {cell.num_output})"
    return s


def _cell_html(cell: Cell, tip: str) -> str:
    en = cell.entry
    if en is None:
        mark = "✕" if cell.state == "preempted" else ""
        return f'<td class="{cell.state}" title="{_q(tip)}">{mark}</td>'
    if en.phase == "decode":
        cls, text = "decode", ""
    else:
        cls, text = ("recompute" if cell.recompute else en.phase), str(en.num_tokens)
    if cell.finished:
        cls += " fin"
        text = text or "✓"
    return f'<td class="{cls}" title="{_q(tip)}">{text}</td>'


def _timeline_table(trace: Trace, tl: Timeline) -> str:
    ev = tl.events
    rows = ['<table class="tl" id="timeline"><thead><tr><th>step</th>']
    rows += [f"<th>{e.step}</th>" for e in ev]
    rows.append("</tr></thead><tbody>")
    for n, rid in enumerate(tl.rows):
        lbl = tl.labels[rid]
        req = trace.request_of(rid)
        prompt = req.prompt if req and req.prompt is not None else ""
        rows.append(f'<tr><th title="{_q(prompt)}"><span class="lbl" style="background:{_color(n)}">{_q(lbl)}</span></th>')
        outs: list[int] = []
        for i in range(len(ev)):
            en = tl.cells[rid][i].entry
            if en is not None and en.generated_token_ids:
                outs.extend(en.generated_token_ids)
            elif en is not None and en.sampled_token_id is not None:
                outs.append(en.sampled_token_id)
            rows.append(_cell_html(tl.cells[rid][i], cell_tip(trace, tl, rid, i, outs)))
        rows.append("</tr>")
    rows.append('<tr class="sep"><th></th></tr>')
    total_blocks = max((e.kv_blocks_total for e in ev), default=1) or 1
    budget = trace.settings.get("max_num_batched_tokens") or max((e.num_batched_tokens for e in ev), default=1) or 1
    max_ms = max((e.duration for e in ev), default=0.0) or 1.0

    def bar_row(cls: str, name: str, vals: list[float], top: float, tips: list[str]) -> None:
        rows.append(f'<tr class="bars {cls}"><th>{_q(name)}</th>')
        for v, t in zip(vals, tips):
            h = 0 if top <= 0 else max(2 if v > 0 else 0, round(100 * min(v, top) / top))
            rows.append(f'<td title="{_q(t)}"><div class="bar" style="height:{h}%"></div></td>')
        rows.append("</tr>")

    bar_row("kv", f"KV blocks /{total_blocks}", [e.kv_blocks_used for e in ev], total_blocks,
            [f"step {e.step}: {e.kv_blocks_used} of {e.kv_blocks_total} KV blocks in use" for e in ev])
    bar_row("tok", f"batch tokens /{budget}", [e.num_batched_tokens for e in ev], budget,
            [f"step {e.step}: {e.num_batched_tokens} tokens in the batch (budget {budget}); "
             f"{e.num_decode} decode + {e.num_prefill_tokens} prefill" for e in ev])
    bar_row("ms", "step time", [e.duration for e in ev], max_ms,
            [f"step {e.step}: {_ms(e.duration)} (forward {_ms(e.forward_time)})" for e in ev])
    rows.append('<tr class="nums"><th>seqs in batch</th>' + "".join(f"<td>{len(e.entries)}</td>" for e in ev) + "</tr>")
    rows.append("</tbody></table>")
    return "".join(rows)


def _legend() -> str:
    items = [("var(--wait)", "waiting"), ("var(--prefill)", "prefill (token count)"),
             ("var(--chunk)", "prefill chunk (token count)"), ("var(--recompute)", "re-prefill after preemption"),
             ("var(--decode)", "decode (1 token)"), ("var(--finish)", "finished in this step ✓"),
             ("var(--preempt)", "preempted ✕"), ("var(--stall)", "running, no token budget left")]
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_q(t)}</span>' for c, t in items) + "</div>"


def _kv_svg(trace: Trace, tl: Timeline) -> str:
    """Each request's KV length after every step: the seed's growing cache, one line per request."""
    ev = tl.events
    if not ev:
        return ""
    w, h, left, right, top, bottom = 820, 240, 48, 90, 12, 30
    pw, ph = w - left - right, h - top - bottom
    kv_top = max((en.kv_len_after for e in ev for en in e.entries), default=1) or 1
    step = _nice_step(kv_top / 4)
    kv_max = step * -(-kv_top // step)  # round the axis up to a whole tick
    n = len(ev)

    def x(i: float) -> float:
        return left + (pw * (i + 0.5) / n)

    def y(v: float) -> float:
        return top + ph - ph * v / kv_max

    parts = [f'<svg id="kvchart" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'role="img" aria-label="KV cache length per request">']
    for k in range(int(kv_max // step) + 1):  # horizontal grid
        v = k * step
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eef0f3"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    ticks = max(1, n // 12)
    for i in range(0, n, ticks):
        parts.append(f'<text x="{x(i):.1f}" y="{h - 12}" text-anchor="middle">{ev[i].step}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{h - 1}" text-anchor="middle">step</text>')
    parts.append(f'<text x="12" y="{top + ph / 2}" transform="rotate(-90 12 {top + ph / 2})" '
                 f'text-anchor="middle">KV tokens</text>')
    for r, rid in enumerate(tl.rows):
        pts: list[str] = []
        last = 0
        segs: list[list[str]] = []
        for i in range(n):
            c = tl.cells[rid][i]
            if c.entry is not None:
                last = c.entry.kv_len_after
            elif c.state == "preempted":
                last = 0
            elif c.state in ("waiting", "done"):
                if pts:
                    segs.append(pts)
                pts = []
                continue
            pts.append(f"{x(i):.1f},{y(last):.1f}")
        if pts:
            segs.append(pts)
        color = _color(r)
        for s in segs:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(s)}"/>')
            if len(s) <= 160:  # one dot per step: the cache grows in steps of one token
                parts += [f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="2.4" fill="{color}"/>' for p in s]
        if segs:
            lx, ly = segs[-1][-1].split(",")
            parts.append(f'<text x="{float(lx) + 6:.1f}" y="{float(ly) + 4:.1f}" style="fill:{color};font-weight:700">'
                         f'{_q(tl.labels[rid])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _nice_step(raw: float) -> int:
    """A round tick spacing (1, 2, 5, 10, 20, 50 ...) at least `raw`."""
    base = 1
    while True:
        for m in (1, 2, 5):
            if base * m >= raw:
                return base * m
        base *= 10


def _tokenization(trace: Trace) -> str:
    out = []
    for n, r in enumerate(trace.requests):
        lbl = "".join(ch for ch in (r.samples[0].label if r.samples else "?") if not ch.isdigit())
        prompt = r.prompt if r.prompt is not None else complete_text(trace.tokens, r.prompt_token_ids)
        extra = " — the seed draws it as 7 tokens (token1 … token7)" if r.prompt == SEED_PROMPT else ""
        out.append(f'<p><span class="lbl" style="background:{_color(n)}">{_q(lbl)}</span> '
                   f'“{_q(prompt)}” → <b>{len(r.prompt_token_ids)} tokens</b>{_q(extra)}</p><div class="chips">')
        for g in group_by_character(trace.tokens, r.prompt_token_ids):
            tip = "\n".join(f"id {t}: {label(trace.tokens.get(t))}" for t in g.ids)
            text = g.text if len(g.ids) > 1 else label(trace.tokens.get(g.ids[0])).strip('"')
            out.append(f'<span class="grp" title="{_q(tip)}"><span class="ch">{_q(visible(text) or "?")}</span>'
                       f'<span class="ids mono">{" ".join(str(t) for t in g.ids)}</span></span>')
        out.append("</div>")
    return "".join(out)


def _requests_table(trace: Trace) -> str:
    rows = ['<table class="req"><tr><th>req</th><th>prompt</th><th>tokens in → out</th><th>TTFT</th>'
            '<th>queue</th><th>TPOT</th><th>preempted</th><th>finish</th><th>output</th></tr>']
    k = 0
    for r in trace.requests:
        for s in r.samples:
            prompt = r.prompt if r.prompt is not None else ""
            rows.append(
                f'<tr><td><span class="lbl" style="background:{_color(k)}">{_q(s.label)}</span></td>'
                f'<td>{_q(shorten(visible(prompt), 40))}</td>'
                f'<td class="num">{len(r.prompt_token_ids)} → {len(s.output_token_ids)}</td>'
                f'<td class="num">{_ms(r.ttft)}</td><td class="num">{_ms(r.queue_time)}</td>'
                f'<td class="num">{_ms(r.tpot)}</td><td class="num">{r.num_preemptions}</td>'
                f'<td>{_q(s.finish_reason or "–")}</td><td class="mono">{_q(shorten(visible(s.output_text), 60))}</td></tr>')
            k += 1
    rows.append("</table>")
    return "".join(rows)


def _steps_table(trace: Trace, tl: Timeline) -> str:
    rows = ['<table class="steps"><tr><th>step</th><th>ms</th><th>req</th><th>phase</th><th>fed</th>'
            '<th>KV</th><th>sampled</th></tr>']
    for i, e in enumerate(tl.events):
        for j, en in enumerate(e.entries):
            cell = tl.cells[en.request_id][i]
            cls = "recompute" if cell.recompute else en.phase
            if en.num_tokens == 1:
                fed = f"{en.token_ids[0]} {label(trace.tokens.get(en.token_ids[0]))}"
            else:
                fed = f'{en.num_tokens} tokens "{shorten(visible(complete_text(trace.tokens, en.token_ids)), 24)}"'
            sampled = "–" if en.sampled_token_id is None else \
                f"{en.sampled_token_id} {label(trace.tokens.get(en.sampled_token_id))}"
            if en.finished:
                sampled += f"  ■ {en.finish_reason}"
            first = j == 0
            rows.append(
                f'<tr class="{"first" if first else ""}"><td class="r">{e.step if first else ""}</td>'
                f'<td class="r">{f"{e.duration * 1000:.1f}" if first else ""}</td>'
                f'<td>{_q(tl.labels[en.request_id])}</td><td class="ph-{cls}">{_q(_phase_words(cell))}</td>'
                f'<td class="mono">{_q(fed)}</td><td class="r">{en.kv_len_before} → {en.kv_len_after}</td>'
                f'<td class="mono">{_q(sampled)}</td></tr>')
        if e.preempted:
            names = " ".join(tl.labels.get(r, r) for r in e.preempted)
            rows.append(f'<tr><td></td><td></td><td class="pre">{_q(names)}</td>'
                        f'<td class="pre" colspan="4">preempted: KV blocks freed, back to the queue (recomputed later)</td></tr>')
    rows.append("</table>")
    return "".join(rows)


def render_html(trace: Trace) -> str:
    tl = Timeline(trace)
    s = trace.settings
    sp = s.get("sampling", {})
    greedy = (sp.get("temperature", 0.0) or 0.0) < 1e-5
    meta = [f"{len(trace.requests)} request(s)", "greedy" if greedy else f"temperature {sp.get('temperature')}"]
    meta += [f"{k} {s[k]}" for k in ("max_num_seqs", "max_num_batched_tokens", "block_size") if k in s]
    if tl.events:
        meta.append(f"{tl.events[0].kv_blocks_total} KV blocks")
    wall = trace.wall_time
    tps = trace.total_output_tokens / wall if wall > 0 else 0.0
    summary = (f"{len(tl.events)} steps in {_ms(wall)} · {trace.total_output_tokens} new tokens · "
               f"{tps:.1f} tokens/s")
    when = _dt.datetime.fromtimestamp(trace.created).strftime("%Y-%m-%d %H:%M") if trace.created else ""
    body = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>tokenloom trace · {_q(trace.model)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>tokenloom trace</h1><p class=\"meta\">{_q(trace.model)} · {_q(' · '.join(meta))} · {_q(when)}</p>",
        f"<p class=\"meta\"><b>{_q(summary)}</b></p>",
        "<h2>Timeline: a row per request, a column per step (hover a cell for its tokens)</h2>",
        _legend(),
        f'<div class="scroll">{_timeline_table(trace, tl)}</div>',
        "<h2>KV cache length per request (grows by one token per decode step; a preemption frees it)</h2>",
        f'<div class="scroll">{_kv_svg(trace, tl)}</div>',
        "<h2>Requests</h2>",
        _requests_table(trace),
        f'<p class="note">{_q(MAPPING_NOTE)}</p>',
        "<h2>Tokenization (hover for each token's id and bytes)</h2>",
        _tokenization(trace),
        "<h2>Every step</h2>",
        f'<div class="scroll">{_steps_table(trace, tl)}</div>',
        '<div id="tip"></div>',
        f"<script>{_JS}</script>",
        "</body></html>",
    ]
    return "\n".join(body)
