"use strict";
// tokenloom live dashboard: reads /dashboard/events (server-sent events) and draws the
// seed's picture -- rows = requests, columns = engine steps -- plus tiles and time series.
// Plain JS and <canvas>; no library.  Counters the browser test reads are data-attributes.
(() => {
  const $ = (id) => document.getElementById(id);
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue(name).trim();
  const KIND_COLOR = [color("--decode"), color("--chunk"), color("--prefill"), color("--recompute")];
  const KIND_COUNTER = ["decodeCells", "chunkCells", "prefillCells", "recomputeCells"];
  const COL_W = 9, GUTTER = 78, HEAD = 16, MAX_SERIES = 240;

  const dash = $("dash"), batch = $("batch");
  const state = {
    config: null, interval: 0.25, rows: new Map(), cols: [], pending: [], series: [], recent: [],
    counts: { rows: 0, columns: 0, decodeCells: 0, prefillCells: 0, chunkCells: 0, recomputeCells: 0 },
    updates: 0, stepsSeen: 0, dirtyBatch: true, dirtyCharts: true, lastFrame: performance.now(),
  };

  // ---- formatting --------------------------------------------------------
  const label = (row) => { let s = ""; row += 1; while (row > 0) { row -= 1; s = String.fromCharCode(65 + (row % 26)) + s; row = Math.floor(row / 26); } return s; };
  const num = (x) => x == null ? "–" : x >= 1000 ? (x / 1000).toFixed(x >= 10000 ? 0 : 1) + "k" : (Math.round(x * 10) / 10).toString();
  const ms = (s) => s == null ? "–" : s * 1000 >= 100 ? (s * 1000).toFixed(0) : (s * 1000).toFixed(1);
  const pair = (o) => !(o && o.n) ? "–" : o.p95 >= 1 ? `${o.p50.toFixed(2)} · ${o.p95.toFixed(2)} s`
    : `${ms(o.p50)} · ${ms(o.p95)} ms`;
  const set = (id, text, value) => { const el = $(id); el.textContent = text; if (value !== undefined) el.dataset.value = value; };

  // ---- the stream ----------------------------------------------------------
  function connect() {
    const key = new URLSearchParams(location.search).get("key");
    const url = location.pathname.replace(/\/?$/, "/events") + (key ? "?key=" + encodeURIComponent(key) : "");
    const es = new EventSource(url);
    const status = $("status");
    es.addEventListener("hello", (e) => { onHello(JSON.parse(e.data)); status.dataset.state = "live"; status.textContent = "live"; });
    es.addEventListener("update", (e) => onUpdate(JSON.parse(e.data)));
    es.onerror = () => {
      const closed = es.readyState === EventSource.CLOSED;
      status.dataset.state = closed ? "closed" : "connecting";
      status.textContent = closed ? "disconnected (reload; is the key right?)" : "reconnecting…";
    };
  }

  function onHello(msg) {
    const c = state.config = msg.config;
    state.interval = msg.interval || 0.25;
    for (const r of msg.rows_active || []) addRow(r);
    $("meta").textContent = `${c.model} · ${c.device} ${c.dtype} · budget ${c.max_num_batched_tokens} tokens/step · ` +
      `max_num_seqs ${c.max_num_seqs} · KV ${c.kv_blocks_total} blocks × ${c.block_size}` + (c.prefix_caching ? " · prefix caching" : "");
    set("stat-seqs", `max_num_seqs ${c.max_num_seqs}`);
    $("budget-label").textContent = `budget ${c.max_num_batched_tokens} tokens`;
  }

  function addRow([row, id, prompt]) {
    if (state.rows.has(row)) return;
    state.rows.set(row, { row, id, prompt, done: null });
    state.counts.rows += 1;
  }

  function onUpdate(m) {
    for (const r of m.rows_new) addRow(r);
    for (const [row, reason] of m.rows_done) { const r = state.rows.get(row); if (r) r.done = reason; }
    for (const s of m.steps) state.pending.push({ step: s[0], t: s[1], dur: s[2], decode: s[3], prefill: s[4], cells: s[5], preempted: s[6] });
    state.updates += 1;
    state.stepsSeen += m.steps_in_update;
    dash.dataset.updates = state.updates;
    dash.dataset.stepsSeen = state.stepsSeen;
    if (m.last_step != null) set("stat-step", m.last_step.toLocaleString(), m.last_step);
    set("stat-steps-rate", m.interval ? `${num(m.steps_in_update / m.interval)} steps/s` : "steps/s –");
    set("stat-running", m.running, m.running);
    set("stat-waiting", m.waiting, m.waiting);
    // Tiles: rates over the last ~2 s (8 updates), steadier than one 0.25-s update.
    state.recent.push({ gen: m.tokens.generated, pre: m.tokens.prefill, dt: m.interval || 0 });
    if (state.recent.length > 8) state.recent.shift();
    const dt = state.recent.reduce((a, r) => a + r.dt, 0);
    const rate = (k) => dt ? state.recent.reduce((a, r) => a + r[k], 0) / dt : 0;
    set("stat-tps", num(rate("gen")), rate("gen").toFixed(1));
    set("stat-prefill-tps", `prefill ${num(rate("pre"))} tok/s`);
    const kv = m.kv;
    set("stat-kv-used", kv.used, kv.used); set("stat-kv-cached", kv.cached, kv.cached); set("stat-kv-free", kv.free, kv.free);
    set("stat-kv-total", `of ${kv.total} blocks · ${kv.total ? (100 * kv.used / kv.total).toFixed(1) : 0}% used`);
    $("kv-bar-used").style.width = kv.total ? `${100 * kv.used / kv.total}%` : "0";
    set("stat-preempt", m.preemptions.total, m.preemptions.total);
    const L = m.latency;
    set("stat-ttft", pair(L.ttft)); set("stat-ttft-n", `${L.ttft.n} requests · last ${L.window_s}s`);
    set("stat-tpot", pair(L.tpot)); set("stat-tpot-n", `${L.tpot.n} finished`);
    set("stat-itl", pair(L.itl)); set("stat-itl-n", `${L.itl.n} token gaps`);
    state.series.push({ gen: m.tokens_per_s.generated, pre: m.tokens_per_s.prefill, running: m.running, waiting: m.waiting,
      kv: kv.total ? 100 * kv.used / kv.total : 0, kvc: kv.total ? 100 * kv.cached / kv.total : 0,
      ttft95: L.ttft.p95 == null ? null : L.ttft.p95 * 1000, ttft50: L.ttft.p50 == null ? null : L.ttft.p50 * 1000,
      itl95: L.itl.p95 == null ? null : L.itl.p95 * 1000 });
    if (state.series.length > MAX_SERIES) state.series.shift();
    state.dirtyCharts = true;
    if (document.hidden) flush(state.pending.length);  // no animation frames in a hidden tab
  }

  // ---- columns are released smoothly over one update interval ----------------
  function flush(n) {
    for (const col of state.pending.splice(0, n)) {
      state.cols.push(col);
      state.counts.columns += 1;
      for (const [, kind] of col.cells) state.counts[KIND_COUNTER[kind] || "decodeCells"] += 1;
    }
    const keep = Math.max(400, Math.ceil(batch.clientWidth / COL_W) + 50);
    if (state.cols.length > keep) state.cols.splice(0, state.cols.length - keep);
    const c = state.counts, d = batch.dataset;
    d.rows = c.rows; d.columns = c.columns; d.decodeCells = c.decodeCells; d.prefillCells = c.prefillCells;
    d.chunkCells = c.chunkCells; d.recomputeCells = c.recomputeCells;
    state.dirtyBatch = true;
  }

  function frame(now) {
    const dt = now - state.lastFrame;
    state.lastFrame = now;
    if (state.pending.length) {
      const n = state.pending.length > 2000 ? state.pending.length
        : Math.max(1, Math.ceil(state.pending.length * dt / (state.interval * 1000)));
      flush(n);
    }
    if (state.dirtyBatch) { drawBatch(); drawBudget(); state.dirtyBatch = false; }
    if (state.dirtyCharts) { drawCharts(); state.dirtyCharts = false; }
    requestAnimationFrame(frame);
  }

  // ---- canvas helpers ---------------------------------------------------------
  function ctx2d(canvas) {
    const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px ui-monospace, Menlo, Consolas, monospace";
    return [g, w, h];
  }

  function visibleCols(w) {
    const n = Math.max(1, Math.floor((w - GUTTER) / COL_W));
    return state.cols.slice(-n);
  }

  function drawBatch() {
    const [g, w, h] = ctx2d(batch);
    const cols = visibleCols(w);
    const present = new Set();
    for (const col of cols) for (const cell of col.cells) present.add(cell[0]);
    let rows = [...present].sort((a, b) => a - b);
    const maxRows = Math.floor((h - HEAD) / 7);
    const hidden = Math.max(0, rows.length - maxRows);
    if (hidden) rows = rows.slice(hidden);
    batch.dataset.visibleRows = rows.length;
    const rowH = rows.length ? Math.min(20, (h - HEAD) / rows.length) : 20;
    const y = new Map(rows.map((r, i) => [r, HEAD + i * rowH]));
    const x0 = w - cols.length * COL_W;  // newest step at the right edge: the picture scrolls left
    g.fillStyle = "#f8fafc"; g.fillRect(GUTTER, HEAD, w - GUTTER, h - HEAD);
    // step numbers along the top
    g.fillStyle = "#94a3b8"; g.textBaseline = "top";
    cols.forEach((col, i) => { if (col.step % 20 === 0) { g.fillText(String(col.step), x0 + i * COL_W, 2); } });
    // cells
    cols.forEach((col, i) => {
      const x = x0 + i * COL_W;
      for (const [row, kind] of col.cells) {
        const yy = y.get(row);
        if (yy === undefined) continue;
        g.fillStyle = KIND_COLOR[kind] || KIND_COLOR[0];
        g.fillRect(x + 1, yy + (rowH > 6 ? 1 : 0), COL_W - 2, Math.max(1, rowH - (rowH > 6 ? 2 : 0)));
      }
      if (col.preempted) { g.fillStyle = color("--preempt"); g.fillRect(x, HEAD - 4, COL_W, 3); }
    });
    // row labels: the seed's letters, prompt length, finish
    g.textBaseline = "middle";
    for (const r of rows) {
      const info = state.rows.get(r), yy = y.get(r) + rowH / 2;
      if (rowH < 9) continue;
      g.fillStyle = info && info.done ? "#94a3b8" : "#0f172a";
      g.font = "bold 11px ui-monospace, Menlo, Consolas, monospace";
      g.fillText(label(r), 4, yy);
      g.font = "10px ui-monospace, Menlo, Consolas, monospace";
      g.fillStyle = "#94a3b8";
      if (info) g.fillText(`${info.prompt} tok${info.done ? " ✓" : ""}`, 30, yy);
    }
    if (hidden) { g.fillStyle = "#64748b"; g.fillText(`+${hidden} more`, 4, HEAD - 6); }
    if (!cols.length) {
      g.fillStyle = "#94a3b8"; g.font = "13px system-ui, sans-serif"; g.textAlign = "center";
      g.fillText("waiting for requests… every engine step will appear here as a column", (w + GUTTER) / 2, h / 2);
      g.textAlign = "start";
    }
  }

  function drawBudget() {
    const canvas = $("budget");
    const [g, w, h] = ctx2d(canvas);
    const cols = visibleCols(w);
    const budget = (state.config && state.config.max_num_batched_tokens) || 1;
    const x0 = w - cols.length * COL_W, top = 6, H = h - top - 2;
    g.fillStyle = "#f8fafc"; g.fillRect(GUTTER, top, w - GUTTER, H);
    cols.forEach((col, i) => {
      const x = x0 + i * COL_W;
      const hd = Math.max(col.decode ? 1 : 0, H * col.decode / budget), hp = H * col.prefill / budget;
      g.fillStyle = color("--decode"); g.fillRect(x + 1, top + H - hd, COL_W - 2, hd);
      g.fillStyle = color("--prefill"); g.fillRect(x + 1, top + H - hd - hp, COL_W - 2, hp);
    });
    g.strokeStyle = "#ef4444"; g.setLineDash([4, 3]); g.beginPath(); g.moveTo(GUTTER, top + 0.5); g.lineTo(w, top + 0.5); g.stroke(); g.setLineDash([]);
    g.fillStyle = "#64748b"; g.textBaseline = "top"; g.fillText("budget", 4, top - 2);
    g.textBaseline = "bottom"; g.fillText("0", 4, h);
  }

  function drawChart(id, lines, opts = {}) {
    const [g, w, h] = ctx2d($(id));
    const data = state.series, pad = { l: 40, r: 6, t: 6, b: 14 };
    let max = opts.max || 0;
    if (!opts.max) for (const p of data) for (const l of lines) { const v = p[l.key]; if (v != null && v > max) max = v; }
    max = niceMax(max || 1);
    const W = w - pad.l - pad.r, H = h - pad.t - pad.b;
    g.strokeStyle = "#e2e8f0"; g.fillStyle = "#94a3b8"; g.textBaseline = "middle"; g.textAlign = "right";
    for (let i = 0; i <= 2; i++) {
      const yy = pad.t + H - (H * i) / 2;
      g.beginPath(); g.moveTo(pad.l, yy + 0.5); g.lineTo(w - pad.r, yy + 0.5); g.stroke();
      g.fillText(num((max * i) / 2), pad.l - 4, yy);
    }
    g.textAlign = "start"; g.textBaseline = "bottom";
    g.fillText(`last ${Math.round(MAX_SERIES * state.interval)}s`, pad.l, h);
    const step = W / (MAX_SERIES - 1), off = MAX_SERIES - data.length;
    for (const l of lines) {
      g.strokeStyle = l.color; g.lineWidth = l.width || 2; g.beginPath();
      let pen = false;
      data.forEach((p, i) => {
        const v = p[l.key];
        if (v == null) { pen = false; return; }
        const xx = pad.l + (off + i) * step, yy = pad.t + H - (H * Math.min(v, max)) / max;
        if (pen) g.lineTo(xx, yy); else { g.moveTo(xx, yy); pen = true; }
      });
      g.stroke();
    }
    g.lineWidth = 1;
  }

  function niceMax(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function drawCharts() {
    drawChart("chart-tps", [{ key: "pre", color: color("--pre") }, { key: "gen", color: color("--gen") }]);
    drawChart("chart-reqs", [{ key: "waiting", color: color("--wait") }, { key: "running", color: color("--run") }]);
    drawChart("chart-kv", [{ key: "kvc", color: color("--kvc") }, { key: "kv", color: color("--kv") }], { max: 100 });
    drawChart("chart-lat", [{ key: "ttft50", color: "#fca5a5" }, { key: "ttft95", color: color("--ttft") },
      { key: "itl95", color: color("--itl") }]);
  }

  window.addEventListener("resize", () => { state.dirtyBatch = state.dirtyCharts = true; });
  connect();
  requestAnimationFrame(frame);
})();
