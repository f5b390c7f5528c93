"""The seed's continuous-batching picture as an image (matplotlib, Agg backend).

Same grid as the HTML page — a row per request (A, B, C ...), a column per step, a
cell per (request, step) coloured by phase — and, on the same step axis, the KV blocks
in use and the tokens in each step's batch split into decode and prefill tokens
against the `max_num_batched_tokens` budget: the two limits the seed names.
"""

from __future__ import annotations

from pathlib import Path

from tokenloom.trace.html import REQUEST_COLORS
from tokenloom.trace.recorder import Trace
from tokenloom.trace.timeline import Timeline

# state -> (face colour, text colour); matches the HTML legend
STATE_COLORS: dict[str, tuple[str, str]] = {
    "waiting": ("#eef0f3", "#6b7280"),
    "prefill": ("#2563eb", "#ffffff"),
    "prefill_chunk": ("#93c5fd", "#1e3a8a"),
    "recompute": ("#a78bfa", "#2e1065"),
    "decode": ("#22c55e", "#ffffff"),
    "finished": ("#15803d", "#ffffff"),
    "preempted": ("#ef4444", "#ffffff"),
    "stalled": ("#fcd34d", "#78350f"),
}
LEGEND = [("waiting", "waiting"), ("prefill", "prefill (tokens)"), ("prefill_chunk", "prefill chunk (tokens)"),
          ("recompute", "re-prefill"), ("decode", "decode"), ("finished", "finished ✓"), ("preempted", "preempted ✕"),
          ("stalled", "no budget")]


def render_png(trace: Trace, path: str | Path, *, dpi: int = 130) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    tl = Timeline(trace)
    ev = tl.events
    n, rows = len(ev), len(tl.rows)
    width = min(22.0, max(9.0, 0.32 * n + 2.5))  # long runs: thinner cells, not a 4000-pixel strip
    grid_h = max(1.2, 0.42 * rows + 0.6)
    fig = plt.figure(figsize=(width, grid_h + 3.6), dpi=dpi)
    fig_h = grid_h + 3.6
    gs = fig.add_gridspec(3, 1, height_ratios=[grid_h, 1.3, 1.3], hspace=0.3, left=0.06 if width > 12 else 0.09,
                          right=0.985, top=1 - 0.85 / fig_h, bottom=0.5 / fig_h)
    ax = fig.add_subplot(gs[0])
    ax_kv = fig.add_subplot(gs[1], sharex=ax)
    ax_tok = fig.add_subplot(gs[2], sharex=ax)
    small = 6 if n > 80 else 7 if n > 40 else 8

    for r, rid in enumerate(tl.rows):
        for i, cell in enumerate(tl.cells[rid]):
            en = cell.entry
            text = ""
            if en is None:
                if cell.state == "done":
                    continue
                key = cell.state
                text = "✕" if cell.state == "preempted" else ""
            elif en.phase == "decode":
                key = "finished" if cell.finished else "decode"
                text = "✓" if cell.finished else ""
            else:
                key = "recompute" if cell.recompute else en.phase
                text = str(en.num_tokens)
                if cell.finished:
                    key = "finished"
            face, fg = STATE_COLORS[key]
            ax.add_patch(Rectangle((i - 0.44, r - 0.38), 0.88, 0.76, facecolor=face, edgecolor="none"))
            if text and n <= 120:
                ax.text(i, r, text, ha="center", va="center", fontsize=small, color=fg, fontweight="bold")
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([tl.labels[r] for r in tl.rows], fontweight="bold")
    for k, t in enumerate(ax.get_yticklabels()):
        t.set_color(REQUEST_COLORS[k % len(REQUEST_COLORS)])
    ax.set_xlim(-0.6, n - 0.4)
    ax.tick_params(axis="x", labelbottom=False, length=0)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [Patch(facecolor=STATE_COLORS[k][0], label=name) for k, name in LEGEND]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 0.98), ncol=len(handles), frameon=False,
              fontsize=8, handlelength=1.2, columnspacing=1.2)

    wall = trace.wall_time
    tps = trace.total_output_tokens / wall if wall > 0 else 0.0
    fig.suptitle(f"tokenloom trace · {Path(trace.model).name or trace.model} · {n} steps · "
                 f"{trace.total_output_tokens} new tokens · {tps:.0f} tokens/s", x=0.01, y=1 - 0.08 / fig_h,
                 ha="left", va="top", fontsize=11, fontweight="bold")
    st = trace.settings
    knobs = " · ".join(f"{k} {st[k]}" for k in ("max_num_seqs", "max_num_batched_tokens", "block_size") if k in st)
    fig.text(0.01, 1 - 0.34 / fig_h, f"a row per request, a column per step · {knobs}", ha="left", va="top",
             fontsize=8.5, color="#6b7280")

    xs = list(range(n))
    total_blocks = max((e.kv_blocks_total for e in ev), default=0)
    ax_kv.bar(xs, [e.kv_blocks_used for e in ev], width=0.8, color="#f59e0b")
    if total_blocks and max((e.kv_blocks_used for e in ev), default=0) > total_blocks * 0.05:
        ax_kv.axhline(total_blocks, color="#92400e", lw=1, ls="--")
        ax_kv.set_ylim(0, total_blocks * 1.08)
    ax_kv.set_ylabel("KV blocks\nin use", fontsize=8)
    ax_kv.set_title(f"KV cache blocks in use (of {total_blocks})", fontsize=9, loc="left")

    dec = [e.num_decode for e in ev]
    pre = [e.num_prefill_tokens for e in ev]
    ax_tok.bar(xs, dec, width=0.8, color="#22c55e", label="decode tokens")
    ax_tok.bar(xs, pre, bottom=dec, width=0.8, color="#60a5fa", label="prefill tokens")
    budget = trace.settings.get("max_num_batched_tokens")
    peak = max((d + p for d, p in zip(dec, pre)), default=0)
    if budget and budget <= 4 * max(peak, 1):  # a budget far above every step would flatten the bars
        ax_tok.axhline(budget, color="#3730a3", lw=1, ls="--", label=f"budget {budget}")
    ax_tok.set_ylabel("tokens\nin batch", fontsize=8)
    ax_tok.set_title("tokens fed per step", fontsize=9, loc="left")
    ax_tok.legend(fontsize=7, frameon=False, loc="upper right", ncol=3)
    ax_tok.set_xlabel("step")
    step_every = max(1, n // 30)
    ax_tok.set_xticks(xs[::step_every])
    ax_tok.set_xticklabels([str(ev[i].step) for i in xs[::step_every]], fontsize=8)
    for a in (ax_kv, ax_tok):
        a.tick_params(axis="y", labelsize=7)
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    ax_kv.tick_params(axis="x", labelbottom=False)

    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
