"""The seed's walk-through, printed from a real run (rich console).

The seed explains one request in sections — tokenization, Prefill, Decode Step 1, 2,
... — and continuous batching as `step1: A B C D / step2: A B C`.  This module prints
the same sections for what the engine actually did:

  1. Tokenization: the prompt's token ids and what each token spells;
  2. every step: each request's phase, the tokens fed, KV length before -> after,
     the token sampled, the step's time;
  3. the batch composition per step in the seed's letters (several requests);
  4. how the real timeline maps to the seed's, and a summary (TTFT, TPOT, tokens/s).
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tokenloom.trace.recorder import Trace
from tokenloom.trace.timeline import Cell, Timeline
from tokenloom.trace.tokens import complete_text, group_by_character, label, visible

SEED_PROMPT = "北京是中国的首都，上海是"

# one colour per request letter, as the seed's A B C D
LETTER_STYLES = ["bold cyan", "bold magenta", "bold green", "bold yellow", "bold blue", "bold red",
                 "bold bright_cyan", "bold bright_magenta"]
PHASE_STYLES = {"prefill": "cyan", "prefill_chunk": "blue", "decode": "green", "preempted": "bold red",
                "waiting": "dim", "stalled": "yellow", "done": "dim"}

MAPPING_NOTE = (
    "How this maps to the seed: the seed shows Prefill, then \"Decode Step 1\" producing token8. In the engine "
    "the step that finishes the prefill already samples the first new token from the prompt's last position - "
    "that is the seed's Decode Step 1 - so TTFT = queueing + prefill (all its chunks) + first sample. Each "
    "later decode step feeds the token sampled the step before (1 token), attends to the whole KV cache, and "
    "samples the next: the engine's k-th decode step is the seed's Decode Step k+1, and KV grows by one per step."
)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def letter_style(trace: Trace, lbl: str) -> str:
    idx = next((i for i, s in enumerate(trace.samples()) if s.label == lbl), 0)
    return LETTER_STYLES[idx % len(LETTER_STYLES)]


def shorten(s: str, width: int, *, keep_end: bool = False) -> str:
    """Cut to `width` terminal cells (CJK characters take two) with an ellipsis."""
    if cell_len(s) <= width:
        return s
    out = ""
    chars = reversed(s) if keep_end else iter(s)
    for c in chars:
        if cell_len(out) + cell_len(c) > width - 1:
            break
        out = out + c if not keep_end else c + out
    return "…" + out if keep_end else out + "…"


def fed_text(trace: Trace, cell: Cell) -> Text:
    en = cell.entry
    assert en is not None
    if en.num_tokens == 1:
        tid = en.token_ids[0]
        return Text.assemble((str(tid), "bold"), " ", shorten(label(trace.tokens.get(tid)), 12))
    body = visible(complete_text(trace.tokens, en.token_ids))
    return Text.assemble((f"{en.num_tokens} tok", "bold"), " ", f'"{shorten(body, 10)}"')


def phase_name(cell: Cell) -> Text:
    """The seed's section name for what this request did in this step."""
    en = cell.entry
    assert en is not None
    if en.phase == "decode":
        return Text(f"Decode step {cell.num_output}", PHASE_STYLES["decode"])
    word = "Re-prefill" if cell.recompute else "Prefill"
    if en.phase == "prefill_chunk":
        word += f" chunk {en.kv_len_after}/{cell.target}"
    style = PHASE_STYLES[en.phase]
    if cell.completes_prefill:
        # the step that completes the prompt also samples: that sample is the seed's "Decode Step k"
        return Text.assemble((word, style), (f"\n+ Decode step {cell.num_output}", "green"))
    return Text(word, style)


# ---- sections -----------------------------------------------------------------
def print_header(console: Console, trace: Trace) -> None:
    s = trace.settings
    sp = s.get("sampling", {})
    greedy = (sp.get("temperature", 0.0) or 0.0) < 1e-5
    console.rule(f"[bold]tokenloom trace[/] · {trace.model}")
    bits = [f"{len(trace.requests)} request(s)", "greedy" if greedy else f"temperature {sp.get('temperature')}"]
    if sp.get("max_tokens") is not None:
        bits.append(f"max_tokens {sp['max_tokens']}")
    for k in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if k in s:
            bits.append(f"{k} {s[k]}")
    if trace.events:
        bits.append(f"kv blocks {trace.events[0].kv_blocks_total}")
    console.print(Text(" · ".join(bits), "dim"))


def print_tokenization(console: Console, trace: Trace) -> None:
    console.print()
    console.rule("Tokenization", align="left", style="dim")
    example = None
    for r in trace.requests:
        lbl = "".join(ch for ch in r.samples[0].label if not ch.isdigit()) if r.samples else "?"
        prompt = r.prompt if r.prompt is not None else complete_text(trace.tokens, r.prompt_token_ids)
        head = Text.assemble((lbl, letter_style(trace, r.samples[0].label) if r.samples else ""), "  ",
                             f'"{shorten(visible(prompt), 60)}"', " → ", (f"{len(r.prompt_token_ids)} tokens", "bold"))
        if r.error:
            console.print(head, Text(f"  refused: {r.error}", "red"))
            continue
        console.print(head)
        if r.prompt == SEED_PROMPT:
            console.print(Text(f"   (the seed draws it as 7 tokens, token1 … token7; this vocabulary needs "
                               f"{len(r.prompt_token_ids)})", "dim"))
        ids = r.prompt_token_ids
        _flow(console, [Text(("ids [" if k == 0 else "") + str(t) + ("]" if k == len(ids) - 1 else ","), "dim")
                        for k, t in enumerate(ids)], indent=3, gap=1)
        chips: list[Text] = []
        for g in group_by_character(trace.tokens, r.prompt_token_ids):
            if len(g.ids) == 1:
                chip = Text.assemble((label(trace.tokens.get(g.ids[0])), "bold"), (f":{g.ids[0]}", "dim"))
            else:
                chip = Text.assemble((visible(g.text) or "?", "bold"), (":" + "+".join(str(t) for t in g.ids), "dim"))
                if example is None and g.text:
                    example = g
            chips.append(chip)
        _flow(console, chips, indent=3)
    if example is not None:
        parts = ", ".join(f"{t} = {label(trace.tokens.get(t))}" for t in example.ids)
        console.print(Text(f"   one token can be part of a character: {parts} together spell "
                           f"{example.text!r} (UTF-8 is {len(example.text.encode())} bytes per such character)", "dim"))


def _flow(console: Console, chips: list[Text], indent: int, gap: int = 2) -> None:
    """Lay chips out on lines without breaking one chip across lines."""
    width = max(20, console.width - indent)
    line = Text(" " * indent)
    used = 0
    for chip in chips:
        w = chip.cell_len + gap
        if used and used + w > width:
            console.print(line, no_wrap=True, overflow="ellipsis")
            line, used = Text(" " * indent), 0
        line.append_text(chip)
        line.append(" " * gap)
        used += w
    if used:
        console.print(line, no_wrap=True, overflow="ellipsis")


def print_steps(console: Console, trace: Trace, tl: Timeline) -> None:
    console.print()
    console.rule("Steps: what each step fed, the KV cache, what it sampled", align="left", style="dim")
    multi = len(tl.rows) > 1
    table = Table(show_edge=False, pad_edge=False, header_style="bold", box=None, padding=(0, 1))
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("ms", justify="right", style="dim", no_wrap=True)
    if multi:
        table.add_column("req", no_wrap=True)
    table.add_column("phase", no_wrap=True, min_width=15)
    table.add_column("fed (id token)", no_wrap=True, overflow="ellipsis")
    table.add_column("KV", justify="right", no_wrap=True)
    table.add_column("sampled (id token)", no_wrap=True, overflow="ellipsis")
    table.add_column("output so far", overflow="fold", ratio=1, min_width=12)
    out_ids: dict[str, list[int]] = {rid: [] for rid in tl.rows}
    for i, e in enumerate(tl.events):
        for j, en in enumerate(e.entries):
            cell = tl.cells[en.request_id][i]
            if en.generated_token_ids:  # with speculative decoding a step can append several
                out_ids[en.request_id].extend(en.generated_token_ids)
            elif en.sampled_token_id is not None:
                out_ids[en.request_id].append(en.sampled_token_id)
            kv = Text.assemble(str(en.kv_len_before), "→", (str(en.kv_len_after), "bold"))
            if en.sampled_token_id is None:
                sampled = Text("— prompt not done", "dim")
            else:
                sampled = Text.assemble((str(en.sampled_token_id), "bold"), " ",
                                        shorten(label(trace.tokens.get(en.sampled_token_id)), 12))
                if en.draft_token_ids:
                    sampled.append(f" (+{en.num_accepted_tokens}/{len(en.draft_token_ids)} drafts)", "cyan")
            so_far = visible(complete_text(trace.tokens, out_ids[en.request_id], final=en.finished))
            out_text = Text(f'"{shorten(so_far, 30, keep_end=True)}"')
            if en.finished:
                out_text.append(f" ■ {en.finish_reason}", "bold red")
            row: list[Text | str] = [str(e.step) if j == 0 else "", f"{e.duration * 1000:.1f}" if j == 0 else ""]
            if multi:
                lbl = tl.labels[en.request_id]
                row.append(Text(lbl, letter_style(trace, lbl)))
            row += [phase_name(cell), fed_text(trace, cell), kv, sampled, out_text]
            table.add_row(*row, end_section=j == len(e.entries) - 1 and multi and not e.preempted)
        if e.preempted:
            names = " ".join(tl.labels.get(r, r) for r in e.preempted)
            row = ["", ""] + ([Text("")] if multi else []) + [Text(f"preempted {names}", "bold red"),
                                                               Text("KV blocks freed, requeued", "red"),
                                                               "", "", ""]
            table.add_row(*row, end_section=multi)
    console.print(table)


def print_batches(console: Console, trace: Trace, tl: Timeline) -> None:
    console.print()
    console.rule("Continuous batching, as the seed draws it (step: who is in the batch)", align="left", style="dim")
    budget = trace.settings.get("max_num_batched_tokens")
    width = max(len(str(e.step)) for e in tl.events) if tl.events else 1
    lines = []
    for i, e in enumerate(tl.events):
        b = tl.batch_line(i)
        line = Text(f"step {e.step:>{width}}: ")
        for lbl, note in b.members:
            line.append(lbl, letter_style(trace, lbl))
            if note:
                line.append(f"({note})", "blue" if "prefill" in note else "")
            if any(lbl == f for f, _ in b.finished):
                line.append("✓", "bold green")
            line.append(" ")
        lines.append((e, b, line))
    # pad the batches to one width (within reason) so the budget / KV columns line up
    pad = min(max((ln.cell_len for _, _, ln in lines), default=0), 64)
    for e, b, line in lines:
        if line.cell_len < pad:
            line.append(" " * (pad - line.cell_len))
        side = [f"{e.num_batched_tokens}{'/' + str(budget) if budget else ''} tok",
                f"KV {e.kv_blocks_used}/{e.kv_blocks_total} blocks"]
        if b.waiting:
            side.append("waiting " + " ".join(b.waiting))
        if b.stalled:
            side.append("no budget " + " ".join(b.stalled))
        tail = Text("  · " + " · ".join(side), "dim")
        if b.preempted:
            tail.append("  · preempted " + " ".join(b.preempted), "bold red")
        if b.finished:
            tail.append("  · finished " + " ".join(f"{who}({why})" for who, why in b.finished), "green")
        line.append_text(tail)
        console.print(line)


def print_summary(console: Console, trace: Trace) -> None:
    console.print()
    console.print(Text(MAPPING_NOTE, "italic"))
    console.print()
    console.rule("Summary", align="left", style="dim")
    for r in trace.requests:
        if r.error:
            lbl = r.samples[0].label if r.samples else "?"
            console.print(Text.assemble((f"{lbl:<3}", letter_style(trace, lbl)), ("refused: ", "bold red"), r.error))
            continue
        for s in r.samples:
            line = Text.assemble((f"{s.label:<3}", letter_style(trace, s.label)), (f"TTFT {ms(r.ttft)}", "bold"))
            if r.queue_time is not None and r.ttft is not None:
                line.append(f" = queue {ms(r.queue_time)} + prefill & first sample {ms(r.ttft - r.queue_time)}", "dim")
            tpot = r.tpot
            line.append("\n   ")
            line.append(f"TPOT {ms(tpot)}", "bold")
            if tpot:
                line.append(f" ({1 / tpot:.1f} tokens/s while decoding)", "dim")
            line.append(f" · {len(r.prompt_token_ids)} prompt + {len(s.output_token_ids)} new tokens")
            line.append(" · finish ")
            line.append(s.finish_reason or "-", "bold")
            if r.num_preemptions:
                line.append(f" · preempted {r.num_preemptions}x", "red")
            console.print(line)
            console.print(Text(f'   "{visible(s.output_text)}"', "dim"), overflow="fold")
    n_steps = len(trace.events)
    if n_steps:
        wall = trace.wall_time
        mean_step = sum(e.duration for e in trace.events) / n_steps
        mean_batch = sum(len(e.entries) for e in trace.events) / n_steps
        tps = trace.total_output_tokens / wall if wall > 0 else 0.0
        console.print(Text.assemble(
            ("all ", "bold"),
            f"{n_steps} steps in {ms(wall)} · {trace.total_output_tokens} new tokens · ",
            (f"{tps:.1f} tokens/s", "bold"),
            f" · mean step {ms(mean_step)} · mean batch {mean_batch:.2f} requests",
        ))


def render_text(trace: Trace, console: Console | None = None, *, steps: bool = True, batches: bool | None = None) -> None:
    """Print the whole walk-through.  `batches=None`: only when several sequences ran."""
    console = console or Console()
    tl = Timeline(trace)
    print_header(console, trace)
    print_tokenization(console, trace)
    if steps and tl.events:
        print_steps(console, trace, tl)
    if batches is None:
        batches = len(tl.rows) > 1
    if batches and tl.events:
        print_batches(console, trace, tl)
    print_summary(console, trace)
