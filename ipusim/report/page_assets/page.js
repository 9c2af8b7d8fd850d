"use strict";
// The page of an ipusim profile (ipusim/report/page.py writes it): decodes the profiles embedded
// in the page and draws the views on canvases. Nothing is fetched: the data is in the page.
(function () {
  const T0 = performance.now();
  const PAGE = JSON.parse(document.getElementById("ipusim-page").textContent);
  const page = window.ipusimPage = {profiles: [], timings: {}, drawTimes: {}, errors: [], view: null};

  // ------------------------------------------------------------------ small helpers
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "style") Object.assign(el.style, v);
      else el.setAttribute(k, v);
    }
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }
  const fmtInt = (n) => (n === null || n === undefined) ? "-" : Math.round(n).toLocaleString("en-US");
  function fmtBytes(b) {
    if (b === null || b === undefined) return "-";
    if (Math.abs(b) >= 1048576) return (b / 1048576).toLocaleString("en-US", {maximumFractionDigits: 2, minimumFractionDigits: 2}) + " MiB";
    if (Math.abs(b) >= 1024) return (b / 1024).toLocaleString("en-US", {maximumFractionDigits: 1, minimumFractionDigits: 1}) + " KiB";
    return fmtInt(b) + " B";
  }
  const pct = (x, d = 1) => (x === null || x === undefined || !isFinite(x)) ? "-" : (100 * x).toFixed(d) + "%";
  function fmtTime(cycles, clock) {
    const s = cycles / clock;
    if (s >= 1) return s.toFixed(3) + " s";
    if (s >= 1e-3) return (s * 1e3).toFixed(3) + " ms";
    return (s * 1e6).toFixed(1) + " \u00b5s";
  }
  function fmtValue(v) {
    if (v === null || v === undefined) return "-";
    if (!Number.isInteger(v)) return Math.abs(v) < 1 ? v.toPrecision(4) : v.toLocaleString("en-US", {maximumFractionDigits: 2, minimumFractionDigits: 2});
    return fmtInt(v);
  }
  const KIND_NAMES = {stashed_activations: "stashed activations", optimiser_state: "optimiser state",
    exchange_buffers: "exchange buffers", host_io: "host I/O", vertex_state: "vertex state", inter_ipu: "inter-IPU",
    host: "host I/O", always_live: "always-live", not_always_live_peak: "not-always-live peak"};
  const kindName = (k) => KIND_NAMES[k] || k.replace(/_/g, " ");
  const KIND_COLOURS = {weights: "#1f77b4", activations: "#ff7f0e", stashed_activations: "#ffbb78",
    optimiser_state: "#9467bd", gradients: "#2ca02c", accumulators: "#98df8a", exchange_buffers: "#17becf",
    temporaries: "#e377c2", constants: "#bcbd22", host_io: "#8c564b", other: "#7f7f7f", vertex_state: "#c5b0d5",
    code: "#393b79", always_live: "#1f77b4", not_always_live_peak: "#ff7f0e"};
  const BUSY_COLOURS = {compute: "#4c72b0", exchange: "#dd8452", sync: "#8c8c8c", inter_ipu: "#c44e52", host: "#55a868"};
  const OP_COLOURS = ["#b0c4de", "#7fb3d5", "#f5b041", "#82e0aa", "#a9a9a9", "#bb8fce"];   // none, F, B, W, U, R
  const OP_NAMES = ["work of no op of its own (copies to it, programs)", "forward", "backward", "weight gradient", "weight update", "recompute"];
  // a sequential scale from pale yellow to dark blue
  const RAMP = [[255, 255, 217], [237, 248, 177], [199, 233, 180], [127, 205, 187], [65, 182, 196], [29, 145, 192],
    [34, 94, 168], [37, 52, 148], [8, 29, 88]];
  function ramp(x) {
    x = Math.max(0, Math.min(1, x)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(x)), f = x - i, a = RAMP[i], b = RAMP[i + 1];
    return `rgb(${Math.round(a[0] + f * (b[0] - a[0]))},${Math.round(a[1] + f * (b[1] - a[1]))},${Math.round(a[2] + f * (b[2] - a[2]))})`;
  }
  function diverging(x) {     // -1 blue .. 0 white .. 1 red
    x = Math.max(-1, Math.min(1, x));
    const c = x < 0 ? [33, 102, 172] : [178, 24, 43], f = Math.abs(x);
    return `rgb(${Math.round(247 + f * (c[0] - 247))},${Math.round(247 + f * (c[1] - 247))},${Math.round(247 + f * (c[2] - 247))})`;
  }
  const EMPTY = "#eef0f3", OOM = "#d62728";
  function upperBound(arr, x, n) {    // first index i with arr[i] > x
    let lo = 0, hi = n;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] > x) hi = mid; else lo = mid + 1; }
    return lo;
  }
  function niceStep(span, ticks) {
    const raw = span / Math.max(1, ticks), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return p * (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10);
  }
  function canvas(width, height, cls) {
    const dpr = window.devicePixelRatio || 1, c = h("canvas", {class: cls || "plot"});
    c.width = Math.round(width * dpr); c.height = Math.round(height * dpr);
    c.style.width = width + "px"; c.style.height = height + "px";
    const ctx = c.getContext("2d"); ctx.scale(dpr, dpr);
    c.cssWidth = width; c.cssHeight = height;
    return [c, ctx];
  }
  function localXY(c, evt) {
    const r = c.getBoundingClientRect();
    return [evt.clientX - r.left, evt.clientY - r.top];
  }
  function table(head, rows, cls) {
    return h("table", {class: cls || "grid"}, h("thead", {}, h("tr", {}, head.map((x) => h("th", {}, x)))),
      h("tbody", {}, rows.map((r) => h("tr", {}, r.map((x) => x instanceof Node ? h("td", {}, x) : h("td", {text: x}))))));
  }
  function swatch(colour) { return h("span", {class: "swatch", style: {background: colour}}); }

  // ------------------------------------------------------------------ tooltip
  const tip = h("div", {id: "tip", role: "tooltip"});
  function showTip(evt, lines, data) {
    tip.replaceChildren(...lines.map((l) => l instanceof Node ? l : h("div", {text: l})));
    for (const k of Object.keys(tip.dataset)) delete tip.dataset[k];
    Object.assign(tip.dataset, data || {});
    tip.style.display = "block";
    const w = tip.offsetWidth, ht = tip.offsetHeight;
    let x = evt.clientX + 14, y = evt.clientY + 14;
    if (x + w > window.innerWidth - 4) x = Math.max(4, evt.clientX - w - 14);
    if (y + ht > window.innerHeight - 4) y = Math.max(4, evt.clientY - ht - 14);
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }

  // ------------------------------------------------------------------ decoding
  function fromBase64(text) {
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(text.trim());
    const bin = atob(text.trim()), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function inflate(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return await new Response(stream).arrayBuffer();
  }
  const TYPES = {u1: Uint8Array, i1: Int8Array, u2: Uint16Array, i2: Int16Array, u4: Uint32Array, i4: Int32Array, f8: Float64Array};
  function readProfile(buffer, index) {
    const n = new DataView(buffer).getUint32(0, true);
    const meta = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, n)));
    const base = 4 + n, cols = {};
    for (const [name, [code, offset, length]] of Object.entries(meta.columns)) {
      const T = TYPES[code];
      cols[name] = new T(buffer, base + offset, length);
    }
    const P = {index, meta, cols, col: (name) => cols[name], str: (i) => meta.strings[i], state: {}};
    P.letter = PAGE.profiles > 1 ? "AB"[index] : "";
    P.I = meta.num_ipus; P.mem = meta.memory; P.T = meta.memory.tiles; P.S = meta.steps.count;
    P.clock = meta.target.clock_hz;
    // per step and IPU (index j * I + i): busy cycles of each kind, their total, live bytes
    const I = P.I, S = P.S, row = cols["step_ipu.row"], total = new Float64Array(S * I);
    const expand = (table) => { const out = new Float64Array(S * I); for (let j = 0; j < S * I; j++) out[j] = table[row[j]]; return out; };
    P.busy = {};
    for (const k of meta.steps.busy_kinds) { const c = P.busy[k] = expand(cols["row.busy." + k]); for (let j = 0; j < S * I; j++) total[j] += c[j]; }
    P.busyTotal = total;
    P.live = expand(cols["row.live"]);
    const start = cols["step.start"], cyc = cols["step.cycles"];
    P.end = S ? start[S - 1] + cyc[S - 1] : 0;
    P.stepEnd = new Float64Array(S);
    for (let j = 0; j < S; j++) P.stepEnd[j] = start[j] + cyc[j];
    return P;
  }

  // ------------------------------------------------------------------ layout and views
  const VIEW_TITLES = {summary: "Summary", memory: "Memory", liveness: "Liveness", execution: "Execution",
    operations: "Operations", compare: "Compare"};
  const header = h("header", {});
  const nav = h("nav", {});
  const main = h("main", {});
  const sections = {};

  function profileTitle(P) {
    const m = P.meta;
    return `${P.letter ? P.letter + " = " : ""}${P.meta.label}: ${m.name} (${m.num_ipus} \u00d7 ${m.target.name}` +
      `${m.execution.schedule ? ", " + m.execution.schedule.strategy : ""}${m.estimated ? ", estimated" : ""})`;
  }

  function perProfile(section, render) {
    const grid = h("div", {class: page.profiles.length > 1 ? "pair" : "single"});
    section.append(grid);
    for (const P of page.profiles) {
      const col = h("div", {class: "column"});
      grid.append(col);
      if (page.profiles.length > 1) col.append(h("h2", {class: "who", text: profileTitle(P)}));
      const body = h("div", {});
      col.append(body);
      render(body, P);
    }
  }

  function columnWidth() {
    const w = main.clientWidth - 32;
    return Math.max(320, page.profiles.length > 1 ? Math.floor((w - 24) / 2) : w);
  }

  // ------------------------------------------------------------------ summary
  function kv(rows) {
    return h("table", {class: "kv"}, h("tbody", {}, rows.filter(Boolean).map(([k, v]) => h("tr", {}, h("th", {text: k}), h("td", {}, v)))));
  }
  function renderSummary(el, P) {
    const m = P.meta, ex = m.execution, tgt = m.target, sched = ex.schedule, st = m.settings || {};
    const first = ex.cycles_per_call.length ? ex.cycles_per_call[0] : 0;
    const samples = st.samples_per_call;
    el.append(h("h3", {text: "Run"}), kv([
      ["profile", `${m.name} (${m.source === "ipusim" ? "plain Engine runs" : "poptorch_lite model"}, written ${m.created}` +
        `${m.estimated ? ", estimated without running" : ""}, schema version ${m.version})`],
      ["target", `${tgt.name}: ${fmtInt(tgt.num_tiles)} tiles \u00d7 ${fmtBytes(tgt.bytes_per_tile)}, ${(tgt.clock_hz / 1e9).toFixed(2)} GHz`],
      ["IPUs", String(m.num_ipus)],
      ["strategy", st.strategy || "-"],
      ["schedule", sched ? `${sched.strategy}: ${sched.micro_batches_per_group} micro-batches per group, ${sched.num_groups} group(s), ` +
        `${sched.num_steps} steps (ramp-up ${sched.ramp_up}, main ${sched.main}, ramp-down ${sched.ramp_down}), bubble ${pct(sched.bubble_fraction)}` : "none (program runs)"],
      st.micro_batch_size !== undefined && ["batching", `micro-batch ${st.micro_batch_size}, gradient accumulation ${st.gradient_accumulation}, ` +
        `device iterations ${st.device_iterations}, replicas ${st.replication_factor}: ${fmtInt(samples)} samples per call (${st.mode || ""} mode)`],
      [m.source === "ipusim" ? "cycles, first run" : "cycles per call", `${fmtInt(first)} = ${fmtTime(first, tgt.clock_hz)}` +
        `${ex.calls > 1 ? `; ${ex.calls} calls, ${fmtInt(ex.total_cycles)} cycles in all` : ""}`],
      samples && first && ["throughput", `${fmtInt(samples / (first / tgt.clock_hz))} samples/s (emulated)`],
      ["traffic per call", `inter-IPU ${fmtBytes(ex.inter_ipu.bytes_per_call)}, host I/O ${fmtBytes(ex.host_bytes_per_call)}, ` +
        `on-chip exchange ${fmtBytes(ex.exchange_bytes_per_call)}`],
    ]));
    // utilisation
    const total = ex.total_cycles || 1;
    el.append(h("h3", {text: "Utilisation per IPU (shares of the run time)"}), table(
      ["IPU", "busy", "idle", "bubble", "wait", "compute", "exchange", "sync", "inter-IPU", "host I/O"],
      ex.ipus.map((u) => [String(u.ipu), pct(u.utilisation), pct(1 - u.utilisation), pct(u.bubble_fraction), pct(u.imbalance_fraction),
        pct(u.busy.compute / total), pct(u.busy.exchange / total), pct(u.busy.sync / total), pct(u.busy.inter_ipu / total), pct(u.busy.host / total)])));
    // memory against capacity
    const mem = P.mem.ipus;
    el.append(h("h3", {text: "Memory per IPU against capacity"}), table(["IPU", "bytes", "of capacity", "", "busiest tile", "of a tile", "fits"],
      mem.map((r) => [String(r.ipu), fmtBytes(r.total_bytes), `${fmtBytes(r.capacity_bytes)}`,
        h("div", {class: "bar"}, h("div", {style: {width: Math.max(0.5, 100 * r.total_bytes / r.capacity_bytes) + "%"}}), h("span", {text: pct(r.total_bytes / r.capacity_bytes, 2)})),
        `tile ${r.max_tile}: ${fmtInt(r.max_tile_bytes)} B`, pct(r.max_tile_bytes / r.tile_capacity_bytes), r.fits ? "yes" : "OUT OF MEMORY"]), "grid memtable"));
    // stages
    if (ex.stages && ex.stages.length) {
      const cell = (x) => x ? fmtInt(x.cycles_per_micro_batch) : "-";
      el.append(h("h3", {text: "Stages (cycles per micro-batch, with receives and sends)"}), table(["stage", "IPU", "blocks", "forward", "backward", "weight gradient"],
        ex.stages.map((s) => [String(s.stage), String(s.ipu), s.blocks.join(", "), cell(s.forward), cell(s.backward), cell(s.weight_gradient)])));
    }
    const ls = ex.longest_stage;
    if (ls) el.append(h("p", {text: `Longest stage: stage ${ls.stage} on IPU ${ls.ipu} (blocks ${ls.blocks.join(", ")}), ` +
      `${fmtInt(ls.cycles_per_micro_batch)} cycles per micro-batch: ${pct(ls.share_of_work)} of the work of all stages ` +
      `(${pct(ls.balanced_share)} if balanced); its IPU sets the step time for ${pct(ls.critical_fraction)} of the run.`}));
    // model error
    if (m.model_error.length) {
      el.append(h("h3", {text: "Cycle model against published IPU measurements"}), table(["part", "error", "against", "leaves out"],
        m.model_error.map((e) => [e.what, e.error === null ? "not held against a measurement" : "within " + pct(e.error), e.over, e.leaves_out])));
    }
    el.append(h("h3", {text: "Balance advice"}), m.advice ? h("pre", {class: "advice", text: m.advice}) :
      h("p", {class: "muted", text: "No balance advice: the profile has no block table (plain Engine runs, estimates, or a note below says why)."}));
    if (m.notes.length) el.append(h("h3", {text: "Notes"}), h("ul", {}, m.notes.map((n) => h("li", {text: n}))));
  }

  // ------------------------------------------------------------------ memory
  function tileGrid(T) {
    const cols = T >= 512 ? 64 : Math.max(4, Math.ceil(Math.sqrt(T * 4)));
    return {cols, rows: Math.ceil(T / cols)};
  }
  function mapLayout(width, cols, maps) {
    // maps per row and cell size: as few rows as cells of at least 6 pixels allow, then the largest cells
    const cellFor = (p) => Math.min(12, Math.floor((width / p - 24) / cols));
    let best = 1;
    for (let p = 2; p <= maps; p++) if (cellFor(p) >= 6 && Math.ceil(maps / p) < Math.ceil(maps / best)) best = p;
    return [best, Math.max(3, cellFor(best))];
  }
  function tileKinds(P, t, ipu) {
    const k = ipu * P.T + t, out = [];
    for (const kind of P.mem.kinds) { const v = P.col("tile." + kind)[k]; if (v) out.push([kind, v]); }
    return out.sort((a, b) => b[1] - a[1]);
  }
  function superstepName(P, s) {
    const names = P.mem.superstep_names;
    let program = "";
    for (const r of P.mem.supersteps) if (s >= r.first && s < r.first + r.count) { program = P.meta.programs[r.program].name; break; }
    return [names ? names[s] : "", program];
  }
  function tileTip(evt, P, ipu, t) {
    const k = ipu * P.T + t, bytes = P.col("tile.peak")[k], cap = P.meta.target.bytes_per_tile;
    const lines = [h("div", {class: "tiphead", text: `IPU ${ipu}, tile ${t}`}),
      h("div", {text: `${fmtInt(bytes)} B of ${fmtInt(cap)} (${pct(bytes / cap)})${bytes > cap ? ": OUT OF MEMORY" : ""}`})];
    const rows = tileKinds(P, t, ipu);
    if (rows.length) lines.push(h("table", {class: "tipkinds"}, h("tbody", {}, rows.map(([kind, v]) =>
      h("tr", {}, h("td", {}, swatch(KIND_COLOURS[kind] || "#999"), kindName(kind)), h("td", {class: "num", text: fmtInt(v) + " B"}))))));
    if (P.mem.kind_source !== "peak") lines.push(h("div", {class: "muted", text: "(a version 2 profile: parts of the peak, not kinds)"}));
    const ps = P.col("tile.peak_superstep");
    if (ps && ps[k] >= 0) { const [name, program] = superstepName(P, ps[k]); lines.push(h("div", {class: "muted", text: `peak at superstep ${ps[k]}${name ? ": " + name : ""}${program ? " (" + program + ")" : ""}`})); }
    showTip(evt, lines, {ipu: String(ipu), tile: String(t), bytes: String(bytes), profile: String(P.index)});
  }

  function renderMemory(el, P) {
    const ipus = P.mem.ipus, T = P.T, cap = P.meta.target.bytes_per_tile, state = P.state;
    state.colourBy = state.colourBy || "all"; state.scale = state.scale || "busiest";
    if (!ipus.length || !T) { el.append(h("p", {text: "This profile has no memory figures."})); return; }
    const peak = P.col("tile.peak");
    let oom = 0; for (let k = 0; k < peak.length; k++) if (peak[k] > cap) oom++;
    const kindsWithBytes = P.mem.kinds.filter((k) => { const c = P.col("tile." + k); for (let i = 0; i < c.length; i++) if (c[i]) return true; return false; });
    const body = h("div", {});
    const select = h("select", {"aria-label": "colour tiles by", onchange: (e) => { state.colourBy = e.target.value; draw(); }},
      h("option", {value: "all", text: "all bytes"}), kindsWithBytes.map((k) => h("option", {value: k, text: kindName(k)})));
    select.value = state.colourBy;
    const scale = h("select", {"aria-label": "colour scale", onchange: (e) => { state.scale = e.target.value; draw(); }},
      h("option", {value: "busiest", text: "full colour = busiest tile"}), h("option", {value: "capacity", text: "full colour = tile capacity"}));
    scale.value = state.scale;
    const legend = h("div", {class: "legend"});
    el.append(h("div", {class: "controls"}, h("label", {}, "colour by ", select), h("label", {}, " scale ", scale), legend),
      h("p", {class: oom ? "alert" : "muted", text: oom ? `${oom} tile(s) exceed the ${fmtInt(cap)} bytes of a tile (marked red).` :
        `Every tile fits in its ${fmtInt(cap)} bytes. Hover a tile for its bytes by kind at its peak.`}), body);
    const {cols, rows} = tileGrid(T);
    const width = columnWidth();
    const [perRow, cell] = mapLayout(width, cols, ipus.length);
    const maps = h("div", {class: "maps"});
    body.append(maps);
    const canvases = [];
    ipus.forEach((r, ipu) => {
      const [c, ctx] = canvas(cols * cell + 1, rows * cell + 1, "tilemap");
      c.dataset.ipu = String(ipu); c.dataset.profile = String(P.index);
      const over = [...Array(T).keys()].filter((t) => peak[ipu * T + t] > cap).length;
      maps.append(h("figure", {}, h("figcaption", {text: `IPU ${r.ipu}: ${fmtBytes(r.total_bytes)} of ${fmtBytes(r.capacity_bytes)} (${pct(r.total_bytes / r.capacity_bytes, 2)}); ` +
        `busiest tile ${r.max_tile}: ${fmtInt(r.max_tile_bytes)} B${over ? `; ${over} tile(s) out of memory` : ""}`}), c));
      canvases.push([c, ctx, ipu]);
      c.addEventListener("mousemove", (evt) => {
        const [x, y] = localXY(c, evt), col = Math.floor(x / cell), row = Math.floor(y / cell), t = row * cols + col;
        if (col < 0 || col >= cols || row < 0 || t >= T) { hideTip(); state.hover = null; drawMap(c, ctx, ipu); return; }
        state.hover = [ipu, t]; drawMap(c, ctx, ipu);
        tileTip(evt, P, ipu, t);
      });
      c.addEventListener("mouseleave", () => { hideTip(); state.hover = null; drawMap(c, ctx, ipu); });
    });
    P.tileCenter = (ipu, t) => {
      const c = canvases[ipu][0]; c.scrollIntoView({block: "center"});
      const r = c.getBoundingClientRect();
      return {x: r.left + (t % cols) * cell + cell / 2, y: r.top + Math.floor(t / cols) * cell + cell / 2};
    };
    let full = 1;
    function values() { return state.colourBy === "all" ? peak : P.col("tile." + state.colourBy); }
    function drawMap(c, ctx, ipu) {
      const v = values(), base = ipu * T;
      ctx.clearRect(0, 0, c.cssWidth, c.cssHeight);
      for (let t = 0; t < T; t++) {
        const x = (t % cols) * cell, y = Math.floor(t / cols) * cell, b = v[base + t];
        ctx.fillStyle = peak[base + t] > cap ? OOM : b ? ramp(0.08 + 0.92 * b / full) : EMPTY;
        ctx.fillRect(x + 0.5, y + 0.5, cell - 1, cell - 1);
      }
      if (state.hover && state.hover[0] === ipu) {
        const t = state.hover[1];
        ctx.strokeStyle = "#000"; ctx.lineWidth = 1.5;
        ctx.strokeRect((t % cols) * cell + 0.5, Math.floor(t / cols) * cell + 0.5, cell - 1, cell - 1);
      }
      c.dataset.drawn = "1";
    }
    function draw() {
      const v = values();
      let top = 0; for (let k = 0; k < v.length; k++) if (v[k] > top) top = v[k];
      full = state.scale === "capacity" ? cap : Math.max(1, top);
      for (const [c, ctx, ipu] of canvases) drawMap(c, ctx, ipu);
      const [g, gctx] = canvas(160, 12, "ramp");
      for (let x = 0; x < 160; x++) { gctx.fillStyle = ramp(0.08 + 0.92 * x / 159); gctx.fillRect(x, 0, 1, 12); }
      legend.replaceChildren(swatch(EMPTY), " none ", "0 ", g, ` ${fmtBytes(full)} `, swatch(OOM), " out of memory");
    }
    draw();
    // bytes by kind per IPU
    const totals = ipus.map((r) => P.mem.kind_source === "peak" ? r.by_kind :
      {always_live: r.always_live_bytes, not_always_live_peak: r.not_always_live_peak_bytes, vertex_state: r.vertex_state_bytes, code: r.code_bytes});
    const top = Math.max(1, ...ipus.map((r) => r.total_bytes));
    const rowH = 18, labelW = 56, barW = Math.max(120, width - labelW - 190);
    const [bc, bctx] = canvas(labelW + barW + 190, ipus.length * rowH + 8, "bars");
    bc.dataset.chart = "memory-by-kind";
    const segments = [];
    ipus.forEach((r, i) => {
      let x = labelW; const y = 4 + i * rowH;
      bctx.fillStyle = "#333"; bctx.font = "12px sans-serif"; bctx.textBaseline = "middle";
      bctx.fillText(`IPU ${r.ipu}`, 4, y + rowH / 2 - 1);
      for (const kind of P.mem.kinds) {
        const b = totals[i][kind] || 0; if (!b) continue;
        const w = barW * b / top;
        bctx.fillStyle = KIND_COLOURS[kind] || "#999"; bctx.fillRect(x, y, w, rowH - 4);
        segments.push([x, y, w, rowH - 4, i, kind, b]);
        x += w;
      }
      bctx.fillStyle = "#333";
      bctx.fillText(`${fmtBytes(r.total_bytes)} (${pct(r.total_bytes / r.capacity_bytes, 2)} of ${fmtBytes(r.capacity_bytes)})`, x + 6, y + rowH / 2 - 1);
    });
    bc.addEventListener("mousemove", (evt) => {
      const [x, y] = localXY(bc, evt);
      const s = segments.find(([sx, sy, w, ht]) => x >= sx && x < sx + Math.max(w, 1) && y >= sy && y < sy + ht);
      if (!s) { hideTip(); return; }
      const r = ipus[s[4]];
      showTip(evt, [h("div", {class: "tiphead", text: `IPU ${r.ipu}: ${kindName(s[5])}`}),
        h("div", {text: `${fmtBytes(s[6])} (${pct(s[6] / r.total_bytes)} of the IPU's ${fmtBytes(r.total_bytes)})`})]);
    });
    bc.addEventListener("mouseleave", hideTip);
    el.append(h("h3", {text: P.mem.kind_source === "peak" ? "Bytes per IPU by kind (at each tile's peak)" : "Bytes per IPU by part (version 2 profile)"}),
      h("div", {class: "legend"}, P.mem.kinds.filter((k) => totals.some((t) => t[k])).map((k) => h("span", {class: "key"}, swatch(KIND_COLOURS[k] || "#999"), kindName(k)))), bc);
    // the busiest tiles
    const worst = [];
    ipus.forEach((r, ipu) => {
      if (r.worst_tiles) for (const w of r.worst_tiles) worst.push([ipu, w]);
      else { const order = [...Array(T).keys()].sort((a, b) => peak[ipu * T + b] - peak[ipu * T + a]).slice(0, 10);
        for (const t of order) worst.push([ipu, {tile: t, bytes: peak[ipu * T + t], fits: peak[ipu * T + t] <= cap, tensors: []}]); }
    });
    worst.sort((a, b) => b[1].bytes - a[1].bytes);
    el.append(h("h3", {text: "Busiest tiles"}), table(["IPU", "tile", "bytes", "of a tile", "peak at", "largest tensors there"],
      worst.slice(0, 10).map(([ipu, w]) => [String(ipus[ipu].ipu), String(w.tile), fmtInt(w.bytes), w.fits ? pct(w.bytes / cap) : "OUT OF MEMORY",
        w.superstep_name ? `${w.superstep_name} (${w.program})` : "-",
        (w.tensors || []).slice(0, 3).map((t) => `${t.name} (${kindName(t.kind)}, ${fmtInt(t.bytes)} B)`).join("; ") || "-"]), "grid worst"));
  }

  // ------------------------------------------------------------------ liveness
  function renderLiveness(el, P) {
    const ipus = P.mem.ipus, live = P.col("liveness"), lengths = P.mem.liveness_lengths;
    if (!ipus.length || !live.length) { el.append(h("p", {text: "This profile has no liveness figures."})); return; }
    el.append(h("p", {class: "muted", text: "Bytes live on each IPU at each superstep of the programs, in program order (a Repeat body counted once): " +
      "always-live tensors, vertex state and code (grey) under the tensors that are not always live (blue). The red dot marks the peak."}));
    const width = columnWidth(), chartH = 64, left = 64;
    const selected = {ipu: P.state.livenessIpu || 0}, withBase = P.state.livenessBase !== false;
    el.append(h("label", {class: "controls"}, h("input", {type: "checkbox", checked: withBase ? "checked" : null,
      onchange: (e) => { P.state.livenessBase = e.target.checked; el.replaceChildren(); renderLiveness(el, P); }}),
      "draw the always-live bytes, vertex state and code under the curve (off: scale on the tensors that are not always live)"));
    const detail = h("div", {class: "peak"});
    let offset = 0;
    const charts = [];
    ipus.forEach((r, i) => {
      const S = lengths[i], off = offset; offset += S;
      const fixed = r.always_live_bytes + r.vertex_state_bytes + r.code_bytes, base = withBase ? fixed : 0;
      let max = 0, at = 0; for (let s = 0; s < S; s++) if (live[off + s] > max) { max = live[off + s]; at = s; }
      const [c, ctx] = canvas(width, chartH + 18, "liveness");
      c.dataset.ipu = String(i);
      const W = width - left - 8, top = Math.max(1, base + max);
      ctx.font = "11px sans-serif"; ctx.textBaseline = "middle"; ctx.fillStyle = "#333";
      ctx.fillText(`IPU ${r.ipu}`, 4, 12); ctx.fillStyle = "#777"; ctx.fillText(fmtBytes(top), 4, 28);
      // program bands
      const progs = P.mem.supersteps;
      if (progs.length < W / 3) progs.forEach((p, k) => { if (k % 2) { ctx.fillStyle = "#f4f6f9"; ctx.fillRect(left + p.first / S * W, 2, p.count / S * W, chartH); } });
      const y = (b) => 2 + chartH - chartH * b / top;
      ctx.fillStyle = "#c8ccd2"; ctx.fillRect(left, y(base), W, chartH + 2 - y(base));
      ctx.fillStyle = "#4c72b0";
      for (let px = 0; px < W; px++) {
        const s0 = Math.floor(px / W * S), s1 = Math.max(s0 + 1, Math.floor((px + 1) / W * S));
        let hi = 0; for (let s = s0; s < s1 && s < S; s++) if (live[off + s] > hi) hi = live[off + s];
        if (hi) ctx.fillRect(left + px, y(base + hi), 1, y(base) - y(base + hi));
      }
      const px = left + (at + 0.5) / S * W;
      ctx.fillStyle = OOM; ctx.beginPath(); ctx.arc(px, y(base + max), 3.5, 0, 2 * Math.PI); ctx.fill();
      const [name] = superstepName(P, at);
      ctx.fillStyle = "#333"; ctx.textBaseline = "top";
      const text = `peak ${fmtBytes(fixed + max)} at superstep ${at}${name ? ": " + name : ""}`;
      ctx.fillText(text, Math.min(Math.max(left, px - ctx.measureText(text).width / 2), width - ctx.measureText(text).width - 4), chartH + 4);
      c.dataset.drawn = "1"; c.dataset.peak = String(at);
      charts.push(c);
      c.addEventListener("mousemove", (evt) => {
        const [x] = localXY(c, evt), s = Math.floor((x - left) / W * S);
        if (s < 0 || s >= S) { hideTip(); return; }
        const [nm, program] = superstepName(P, s);
        showTip(evt, [h("div", {class: "tiphead", text: `IPU ${r.ipu}, superstep ${s}`}), nm && h("div", {text: nm}), program && h("div", {class: "muted", text: `program ${program}`}),
          h("div", {text: `not always live: ${fmtBytes(live[off + s])}; with the always-live, vertex state and code ${fmtBytes(fixed)}: ${fmtBytes(fixed + live[off + s])}`})], {superstep: String(s)});
      });
      c.addEventListener("mouseleave", hideTip);
      c.addEventListener("click", () => { selected.ipu = i; P.state.livenessIpu = i; showPeak(); });
    });
    function showPeak() {
      const i = selected.ipu, r = ipus[i], pk = r.liveness_peak;
      charts.forEach((c, k) => c.classList.toggle("selected", k === i));
      if (!pk) {
        detail.replaceChildren(h("h3", {text: `IPU ${r.ipu} at its peak`}), h("p", {class: "muted", text: r.liveness_peak === null ?
          "No tensor that is not always live on this IPU." : "A version 2 profile does not list the tensors alive at the peak."}));
        return;
      }
      detail.replaceChildren(h("h3", {text: `IPU ${r.ipu} at its peak: superstep ${pk.superstep}, ${pk.superstep_name} (program ${pk.program})`}),
        h("p", {text: `${fmtBytes(pk.bytes)} of tensors that are not always live, over ${fmtBytes(r.always_live_bytes)} always live, ` +
          `${fmtBytes(r.vertex_state_bytes)} vertex state and ${fmtBytes(r.code_bytes)} code. By kind: ` +
          Object.entries(pk.by_kind).sort((a, b) => b[1] - a[1]).map(([k, v]) => `${kindName(k)} ${fmtBytes(v)}`).join(", ") + "."}),
        table(["tensor alive there", "kind", "bytes"], pk.tensors.map((t) => [t.name, kindName(t.kind), fmtInt(t.bytes)])));
    }
    el.append(h("div", {class: "charts"}, charts), h("p", {class: "muted", text: "Click a chart for what is alive at that IPU's peak."}), detail);
    showPeak();
  }

  // ------------------------------------------------------------------ execution
  function renderExecution(el, P) {
    const S = P.S, I = P.I;
    if (!S) { el.append(h("p", {text: "This profile lists no executed steps."})); return; }
    const st = P.state, start = P.col("step.start"), cyc = P.col("step.cycles"), kind = P.col("op.kind"),
      stage = P.col("op.stage"), micro = P.col("op.micro_batch"), total = P.busyTotal, label = P.col("step.label");
    st.view = st.view || firstGroup();
    function firstGroup() {    // the first gradient-accumulation group of the first call (at most 80 steps), as the tutorial's figure
      const group = P.col("step.group"), call = P.col("step.call"), scheduled = !!P.meta.execution.schedule;
      let last = 0;
      while (last + 1 < S && last + 1 < 80 && (!scheduled || (call[last + 1] === call[0] && group[last + 1] === group[0]))) last++;
      return [0, last + 1 >= S ? P.end : P.stepEnd[last]];
    }
    const width = columnWidth(), left = 58, rowH = I <= 8 ? 26 : I <= 16 ? 18 : 12, axisH = 20;
    const W = width - left - 6, height = axisH + I * rowH + 4;
    const info = h("span", {class: "muted"});
    const zoom = (f) => { const [a, b] = st.view, mid = (a + b) / 2; setView(mid - (b - a) * f / 2, mid + (b - a) * f / 2); };
    el.append(h("div", {class: "controls"},
      h("button", {type: "button", text: "\u2212", title: "zoom out", onclick: () => zoom(2)}),
      h("button", {type: "button", text: "+", title: "zoom in", onclick: () => zoom(0.5)}),
      h("button", {type: "button", text: "whole run", onclick: () => setView(0, P.end)}),
      P.meta.execution.schedule && h("button", {type: "button", text: "first group", onclick: () => setView(...firstGroup())}), " ", info),
      h("div", {class: "legend"}, [1, 2, 3, 4, 5, 0].filter((k) => hasKind(k)).map((k) => h("span", {class: "key"}, swatch(OP_COLOURS[k]),
        k || P.meta.execution.schedule ? OP_NAMES[k] : "program run")),
        h("span", {class: "key muted", text: "box: busy time of the IPU in the step; blank: idle (wait or bubble)"})));
    function hasKind(k) { for (let j = 0; j < kind.length; j++) if (kind[j] === k) return true; return k === 0 && !kind.some((x) => x); }
    const [ov, octx] = canvas(width, 26, "overview");
    const [c, ctx] = canvas(width, height, "timeline");
    c.dataset.profile = String(P.index);
    el.append(ov, c, h("p", {class: "muted", text: "Wheel or the buttons to zoom, drag to pan, double-click for the whole run; the strip above shows the whole run."}));
    // overview: busy share per pixel column and IPU
    const bins = new Float64Array(W * I);
    const per = P.end / W;
    for (let j = 0; j < S; j++) for (let i = 0; i < I; i++) {
      const b = total[j * I + i]; if (!b) continue;
      const a = start[j] / per, e = (start[j] + b) / per;
      const p0 = Math.min(W - 1, Math.floor(a)), p1 = Math.min(W - 1, Math.floor(e));
      if (p0 === p1) { bins[i * W + p0] += b; continue; }
      for (let px = p0; px <= p1; px++) bins[i * W + px] += Math.max(0, Math.min(px + 1, e) - Math.max(px, a)) * per;
    }
    const overview = document.createElement("canvas");
    overview.width = W; overview.height = I;
    const oc = overview.getContext("2d"), img = oc.createImageData(W, I);
    for (let i = 0; i < I; i++) for (let px = 0; px < W; px++) {
      const f = Math.min(1, bins[i * W + px] / per), o = 4 * (i * W + px);
      img.data[o] = 76 + (1 - f) * 170; img.data[o + 1] = 114 + (1 - f) * 130; img.data[o + 2] = 176 + (1 - f) * 70; img.data[o + 3] = 255;
    }
    oc.putImageData(img, 0, 0);
    function setView(a, b) {
      const minSpan = Math.min(P.end, Math.max(8, P.end / 1e7));
      let span = Math.max(minSpan, Math.min(P.end, b - a));
      a = Math.max(0, Math.min(P.end - span, a));
      st.view = [a, a + span];
      draw();
    }
    function draw() {
      const t0 = performance.now();
      const [v0, v1] = st.view, scale = W / (v1 - v0);
      octx.clearRect(0, 0, width, 26);
      octx.imageSmoothingEnabled = false;
      octx.drawImage(overview, left, 2, W, 22);
      octx.strokeStyle = "#c44e52"; octx.lineWidth = 1.5;
      octx.strokeRect(left + v0 / P.end * W, 1, Math.max(2, (v1 - v0) / P.end * W), 24);
      octx.fillStyle = "#555"; octx.font = "10px sans-serif"; octx.textBaseline = "middle"; octx.fillText("run", 4, 13);
      ctx.clearRect(0, 0, width, height);
      ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
      for (let i = 0; i < I; i++) {
        ctx.fillStyle = i % 2 ? "#f7f8fa" : "#fff"; ctx.fillRect(left, axisH + i * rowH, W, rowH);
        ctx.fillStyle = "#333"; ctx.fillText(`IPU ${i}`, 4, axisH + i * rowH + rowH / 2);
      }
      // axis
      const unitUs = P.clock / 1e6, spanUs = (v1 - v0) / unitUs, step = niceStep(spanUs, Math.max(2, Math.floor(W / 110)));
      ctx.strokeStyle = "#d0d4da"; ctx.fillStyle = "#555"; ctx.lineWidth = 1; ctx.textBaseline = "top";
      ctx.beginPath();
      for (let u = Math.ceil(v0 / unitUs / step) * step; u <= v1 / unitUs; u += step) {
        const x = left + (u * unitUs - v0) * scale;
        ctx.moveTo(Math.round(x) + 0.5, axisH - 4); ctx.lineTo(Math.round(x) + 0.5, height);
        ctx.fillText(`${+u.toPrecision(6)} \u00b5s`, x + 2, 2);
      }
      ctx.stroke();
      const s0 = Math.max(0, upperBound(P.stepEnd, v0, S)), s1 = Math.min(S, upperBound(start, v1, S));
      // step boundaries when they are far enough apart
      if ((s1 - s0) > 0 && W / (s1 - s0) >= 4) {
        ctx.strokeStyle = "#c9ced6"; ctx.setLineDash([2, 2]); ctx.beginPath();
        for (let j = s0; j < s1; j++) { const x = Math.round(left + (start[j] - v0) * scale) + 0.5; if (x >= left) { ctx.moveTo(x, axisH); ctx.lineTo(x, height - 2); } }
        ctx.stroke(); ctx.setLineDash([]);
      }
      ctx.save(); ctx.beginPath(); ctx.rect(left, axisH, W, I * rowH); ctx.clip();
      const paths = OP_COLOURS.map(() => new Path2D());
      const thinBusy = new Float64Array(W), thinKind = new Uint8Array(W);
      const labels = [];
      for (let i = 0; i < I; i++) {
        thinBusy.fill(0);
        const y = axisH + i * rowH + 3, hh = rowH - 6;
        for (let j = s0; j < s1; j++) {
          const k = j * I + i, b = total[k]; if (!b) continue;
          const x = left + (start[j] - v0) * scale, w = b * scale;
          if (w >= 1.5) {
            paths[kind[k]].rect(x, y, w - (w > 4 ? 0.5 : 0), hh);
            if (w > 14) labels.push([x + w / 2, y + hh / 2, w, j, i]);
          } else {
            const px = Math.floor(x - left); if (px < 0 || px >= W) continue;
            thinBusy[px] += b; thinKind[px] = kind[k];
          }
        }
        for (let px = 0; px < W; px++) if (thinBusy[px]) {
          ctx.globalAlpha = Math.min(1, 0.25 + thinBusy[px] * scale);
          ctx.fillStyle = OP_COLOURS[thinKind[px]]; ctx.fillRect(left + px, y, 1, hh);
        }
        ctx.globalAlpha = 1;
      }
      paths.forEach((p, k) => { ctx.fillStyle = OP_COLOURS[k]; ctx.fill(p); });
      ctx.strokeStyle = "rgba(40,40,40,0.5)"; ctx.lineWidth = 0.5;
      if (s1 - s0 < W / 3) paths.forEach((p) => ctx.stroke(p));
      ctx.fillStyle = "#222"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (const [x, y, w, j, i] of labels) {
        const text = opText(j, i, w);
        if (text && ctx.measureText(text).width < w - 4) ctx.fillText(text, x, y);
      }
      ctx.textAlign = "start"; ctx.restore();
      info.textContent = `${fmtTime(v1 - v0, P.clock)} shown of ${fmtTime(P.end, P.clock)}; steps ${s0 + 1}-${s1} of ${S}`;
      c.dataset.drawn = "1"; c.dataset.steps = String(s1 - s0);
      page.drawTimes["execution-frame"] = performance.now() - t0;
    }
    function opText(j, i, w) {
      const k = j * I + i, kd = kind[k];
      if (!kd) return P.str(label[j]);
      if (kd === 4) return "U";
      const mb = micro[k] >= 0 ? micro[k] + 1 : "";
      return `${P.meta.steps.op_kinds[kd]}${mb}` + (w > 60 && stage[k] >= 0 ? ` s${stage[k]}` : "");
    }
    function stepAt(x) {
      const [v0, v1] = st.view, t = v0 + (x - left) / W * (v1 - v0);
      const j = upperBound(start, t, S) - 1;
      return j >= 0 && t < P.stepEnd[j] ? j : -1;
    }
    let drag = null;
    c.addEventListener("mousedown", (evt) => { drag = [evt.clientX, st.view[0], st.view[1]]; c.classList.add("dragging"); evt.preventDefault(); });
    window.addEventListener("mouseup", () => { drag = null; c.classList.remove("dragging"); });
    c.addEventListener("mousemove", (evt) => {
      const [x, y] = localXY(c, evt);
      if (drag) {
        const d = (evt.clientX - drag[0]) / W * (drag[2] - drag[1]);
        setView(drag[1] - d, drag[2] - d); hideTip(); return;
      }
      const i = Math.floor((y - axisH) / rowH), j = x >= left ? stepAt(x) : -1;
      if (i < 0 || i >= I || j < 0) { hideTip(); return; }
      const k = j * I + i, busy = total[k], idle = cyc[j] - busy, kd = kind[k], own = kd > 0;
      const anyOp = (() => { for (let q = 0; q < I; q++) if (kind[j * I + q]) return true; return false; })();
      const lines = [h("div", {class: "tiphead", text: `step ${P.col("step.index")[j] + 1}` + (P.meta.execution.traced_calls > 1 ? ` (call ${P.col("step.call")[j]})` : "") +
        (P.col("step.group")[j] >= 0 ? `, group ${P.col("step.group")[j] + 1}` : "") + `, IPU ${i}`}),
        h("div", {text: own ? `${OP_NAMES[kd]} ${opText(j, i, 100)}${micro[k] >= 0 ? ` (micro-batch ${micro[k] + 1})` : ""}` :
          anyOp ? (busy ? "no op of this IPU in this step: busy with copies to it" : "no op of this IPU in this step") : P.str(label[j])}),
        h("div", {text: `step: ${fmtInt(cyc[j])} cycles = ${fmtTime(cyc[j], P.clock)}, from cycle ${fmtInt(start[j])}; slowest IPU ${P.col("step.critical")[j]}`})];
      const rows = P.meta.steps.busy_kinds.map((bk) => [bk, P.busy[bk][k]]).filter(([, v]) => v);
      rows.push(["idle", idle]);
      lines.push(h("table", {class: "tipkinds"}, h("tbody", {}, rows.map(([bk, v]) => h("tr", {},
        h("td", {}, swatch(BUSY_COLOURS[bk] || "#eee"), bk === "idle" ? (own || !anyOp ? "idle (wait for the slowest IPU)" : "idle (bubble)") : kindName(bk)),
        h("td", {class: "num", text: fmtInt(v)}))))));
      lines.push(h("div", {class: "muted", text: `live on the IPU: ${fmtBytes(P.live[k])}`}));
      showTip(evt, lines, {step: String(j), ipu: String(i), busy: String(busy)});
    });
    c.addEventListener("mouseleave", hideTip);
    c.addEventListener("wheel", (evt) => {
      evt.preventDefault();
      const [x] = localXY(c, evt), [v0, v1] = st.view, f = Math.exp(Math.max(-1, Math.min(1, evt.deltaY * 0.002)));
      const t = v0 + Math.max(0, Math.min(1, (x - left) / W)) * (v1 - v0);
      setView(t - (t - v0) * f, t + (v1 - t) * f);
    }, {passive: false});
    c.addEventListener("dblclick", () => setView(0, P.end));
    ov.addEventListener("mousedown", (evt) => {
      const move = (e) => { const [x] = localXY(ov, e), [v0, v1] = st.view, t = (x - left) / W * P.end; setView(t - (v1 - v0) / 2, t + (v1 - v0) / 2); };
      move(evt);
      const up = () => { window.removeEventListener("mousemove", move); window.removeEventListener("mouseup", up); };
      window.addEventListener("mousemove", move); window.addEventListener("mouseup", up);
    });
    P.setView = setView;
    P.stepCenter = (j, i) => {
      c.scrollIntoView({block: "center"});
      const r = c.getBoundingClientRect(), [v0, v1] = st.view, sc = W / (v1 - v0);
      return {x: r.left + left + (start[j] - v0 + total[j * I + i] / 2) * sc, y: r.top + axisH + i * rowH + rowH / 2};
    };
    draw();
  }

  // ------------------------------------------------------------------ operations
  const shortPath = (s) => { const parts = s.split("/"); return parts.length > 2 ? "\u2026/" + parts.slice(-2).join("/") : s; };
  const OP_COLUMNS = [["name", "op"], ["aten", "ATen op"], ["pass", "pass"], ["block", "block"], ["stage", "stage"], ["ipu", "IPU"],
    ["cycles", "cycles"], ["compute", "compute"], ["exchange", "exchange"], ["sync", "sync"], ["exchange_bytes", "exchange bytes"],
    ["bytes", "tensor bytes"], ["tiles", "tiles"], ["source", "source line"], ["module", "module"]];
  function renderOperations(el, P) {
    const ops = P.meta.operations;
    if (!ops.available || !ops.count) {
      el.append(h("p", {class: "muted", text: ops.available ? "The profile lists no operations (plain Engine runs): its programs instead." :
        "A version 2 profile has no operations table: its programs instead."}));
      el.append(table(["program", "cycles", "busy per IPU", "exchange bytes", "inter-IPU bytes", "host bytes"], P.meta.programs.map((p) =>
        [p.name, fmtInt(p.cycles), p.per_ipu.map(([ipu, total]) => `IPU ${ipu}: ${fmtInt(total)}`).join(", "), fmtInt(p.exchange_bytes), fmtInt(p.inter_ipu_bytes), fmtInt(p.host_bytes)])));
      el.dataset.drawn = "1";
      return;
    }
    const n = ops.count, text = new Set(ops.text), st = P.state;
    const strings = P.meta.strings, lower = strings.map((s) => s.toLowerCase());
    const rank = new Int32Array(strings.length);   // string order, for sorting text columns
    [...strings.keys()].sort((a, b) => strings[a] < strings[b] ? -1 : strings[a] > strings[b] ? 1 : 0).forEach((s, r) => { rank[s] = r; });
    st.sort = st.sort || ["cycles", -1]; st.filter = st.filter || "";
    let order = new Int32Array(0);
    const col = (k) => P.col("ops." + k);
    function compute() {
      const q = st.filter.toLowerCase(), keep = [];
      for (let r = 0; r < n; r++) {
        if (!q || ops.text.some((k) => lower[col(k)[r]].includes(q))) keep.push(r);
      }
      const [key, dir] = st.sort, c = col(key), isText = text.has(key);
      keep.sort((a, b) => { const x = isText ? rank[c[a]] : c[a], y = isText ? rank[c[b]] : c[b]; return (x - y) * dir || a - b; });
      order = Int32Array.from(keep);
    }
    const rowH = 22, viewH = 520;
    const filter = h("input", {type: "search", placeholder: "filter: op, ATen op, block, source, module", value: st.filter,
      oninput: (e) => { st.filter = e.target.value; compute(); scroller.scrollTop = 0; rows(); }});
    const count = h("span", {class: "muted"});
    const headRow = h("tr", {}, OP_COLUMNS.map(([k, title]) => h("th", {"data-key": k, class: text.has(k) ? "" : "num",
      onclick: () => { st.sort = [k, st.sort[0] === k ? -st.sort[1] : (text.has(k) ? 1 : -1)]; compute(); rows(); }}, title)));
    const tbody = h("tbody", {});
    const scroller = h("div", {class: "vt", style: {height: viewH + "px"}}, h("table", {class: "grid ops"}, h("thead", {}, headRow), tbody));
    el.append(h("div", {class: "controls"}, filter, " ", count), scroller,
      h("p", {class: "muted", text: "Cycles per run of the op on its IPU (static estimates); tensor bytes: tile memory of the tensors its lowering made (outputs and temporaries, summed over tiles, live or not); tiles: the tiles its vertices run on. Click a column to sort."}));
    function rows() {
      const first = Math.max(0, Math.floor(scroller.scrollTop / rowH) - 5), last = Math.min(order.length, first + Math.ceil(viewH / rowH) + 10);
      const spacer = (rowsAcross) => h("tr", {class: "spacer"}, h("td", {colspan: String(OP_COLUMNS.length), style: {height: rowsAcross * rowH + "px"}}));
      const out = [spacer(first)];
      for (let q = first; q < last; q++) {
        const r = order[q];
        out.push(h("tr", {"data-row": String(r)}, OP_COLUMNS.map(([k]) => text.has(k) ? h("td", {text: k === "source" ? shortPath(P.str(col(k)[r])) : P.str(col(k)[r]), title: P.str(col(k)[r])}) :
          h("td", {class: "num", text: fmtInt(col(k)[r])}))));
      }
      out.push(spacer(order.length - last));
      tbody.replaceChildren(...out);
      for (const th of headRow.children) th.classList.toggle("sorted", th.dataset.key === st.sort[0]);
      let cycles = 0; for (const r of order) cycles += col("cycles")[r];
      count.textContent = `${order.length} of ${n} ops; ${fmtInt(cycles)} cycles in those shown (one run each)`;
      el.dataset.drawn = "1";
    }
    scroller.addEventListener("scroll", () => requestAnimationFrame(rows));
    compute(); rows();
  }

  // ------------------------------------------------------------------ compare
  function renderCompare(section) {
    const cmp = PAGE.comparison, [A, B] = page.profiles;
    section.append(h("p", {}, h("b", {text: "A"}), ` = ${cmp.labels[0]}: ${A.meta.name}; `, h("b", {text: "B"}), ` = ${cmp.labels[1]}: ${B.meta.name}. Ratios are B / A.`));
    section.append(table(["metric", "A", "B", "B / A"], cmp.rows.map(([name, a, b]) => {
      const ratio = a !== null && b !== null && a !== 0 ? b / a : null;
      const cell = h("span", {class: ratio === null ? "" : ratio > 1.005 ? "up" : ratio < 0.995 ? "down" : "", text: ratio === null ? "-" : ratio.toFixed(3)});
      return [name, fmtValue(a), fmtValue(b), cell];
    }), "grid compare"));
    const width = main.clientWidth - 32;
    // memory per IPU and stage cycles, A beside B
    function grouped(title, labels, a, b, fmt) {
      const rowH = 16, labelW = 90, W = Math.max(200, width - labelW - 160), top = Math.max(1, ...a.filter((x) => x !== null), ...b.filter((x) => x !== null));
      const [c, ctx] = canvas(labelW + W + 160, labels.length * (2 * rowH + 6) + 6, "bars");
      ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
      labels.forEach((l, i) => {
        const y = 4 + i * (2 * rowH + 6);
        ctx.fillStyle = "#333"; ctx.fillText(l, 4, y + rowH);
        [[a[i], "#4c72b0", "A"], [b[i], "#dd8452", "B"]].forEach(([v, colour, who], k) => {
          if (v === null || v === undefined) return;
          ctx.fillStyle = colour; ctx.fillRect(labelW, y + k * rowH, W * v / top, rowH - 2);
          ctx.fillStyle = "#333"; ctx.fillText(`${who}: ${fmt(v)}`, labelW + W * v / top + 4, y + k * rowH + rowH / 2);
        });
      });
      return [h("h3", {text: title}), c];
    }
    const ipuCount = Math.max(A.mem.ipus.length, B.mem.ipus.length), ipuLabels = [...Array(ipuCount).keys()].map((i) => `IPU ${i}`);
    section.append(...grouped("Memory per IPU", ipuLabels, ipuLabels.map((_, i) => A.mem.ipus[i] ? A.mem.ipus[i].total_bytes : null),
      ipuLabels.map((_, i) => B.mem.ipus[i] ? B.mem.ipus[i].total_bytes : null), fmtBytes));
    const sa = A.meta.execution.stages || [], sb = B.meta.execution.stages || [];
    if (sa.length || sb.length) {
      const stageCount = Math.max(sa.length, sb.length), labels = [...Array(stageCount).keys()].map((s) => `stage ${s}`);
      const work = (s) => s ? (s.forward ? s.forward.cycles_per_micro_batch : 0) + (s.backward ? s.backward.cycles_per_micro_batch : 0) : null;
      section.append(...grouped("Cycles per micro-batch of each stage (forward + backward)", labels, labels.map((_, s) => work(sa[s])), labels.map((_, s) => work(sb[s])), fmtInt));
    }
    // tile differences
    if (A.T === B.T && A.mem.ipus.length === B.mem.ipus.length && A.T) {
      const T = A.T, {cols, rows} = tileGrid(T), pa = A.col("tile.peak"), pb = B.col("tile.peak");
      let top = 1; for (let k = 0; k < pa.length; k++) top = Math.max(top, Math.abs(pb[k] - pa[k]));
      const [, cell] = mapLayout(width, cols, A.mem.ipus.length);
      const maps = h("div", {class: "maps"});
      for (let ipu = 0; ipu < A.mem.ipus.length; ipu++) {
        const [c, ctx] = canvas(cols * cell + 1, rows * cell + 1, "tilemap");
        c.dataset.ipu = String(ipu); c.dataset.diff = "1";
        for (let t = 0; t < T; t++) {
          const k = ipu * T + t;
          ctx.fillStyle = pa[k] || pb[k] ? diverging((pb[k] - pa[k]) / top) : EMPTY;
          ctx.fillRect((t % cols) * cell + 0.5, Math.floor(t / cols) * cell + 0.5, cell - 1, cell - 1);
        }
        c.dataset.drawn = "1";
        c.addEventListener("mousemove", (evt) => {
          const [x, y] = localXY(c, evt), t = Math.floor(y / cell) * cols + Math.floor(x / cell);
          if (x >= cols * cell || t >= T) { hideTip(); return; }
          const k = ipu * T + t;
          showTip(evt, [h("div", {class: "tiphead", text: `IPU ${ipu}, tile ${t}`}), h("div", {text: `A: ${fmtInt(pa[k])} B`}), h("div", {text: `B: ${fmtInt(pb[k])} B`}),
            h("div", {text: `B \u2212 A: ${pb[k] - pa[k] >= 0 ? "+" : ""}${fmtInt(pb[k] - pa[k])} B`})], {ipu: String(ipu), tile: String(t)});
        });
        c.addEventListener("mouseleave", hideTip);
        maps.append(h("figure", {}, h("figcaption", {text: `IPU ${ipu}: ${fmtBytes(A.mem.ipus[ipu].total_bytes)} \u2192 ${fmtBytes(B.mem.ipus[ipu].total_bytes)}`}), c));
      }
      const [g, gctx] = canvas(160, 12, "ramp");
      for (let x = 0; x < 160; x++) { gctx.fillStyle = diverging(2 * x / 159 - 1); gctx.fillRect(x, 0, 1, 12); }
      section.append(h("h3", {text: "Bytes per tile, B \u2212 A"}), h("div", {class: "legend"}, `\u2212${fmtBytes(top)} `, g, ` +${fmtBytes(top)}`), maps);
    } else {
      section.append(h("p", {class: "muted", text: "The two profiles have different IPUs or tiles: no tile-by-tile difference."}));
    }
  }

  const RENDER = {summary: renderSummary, memory: renderMemory, liveness: renderLiveness, execution: renderExecution,
    operations: renderOperations};

  function show(view) {
    if (!sections[view]) view = "summary";
    const t0 = performance.now();
    for (const [name, sec] of Object.entries(sections)) sec.hidden = name !== view;
    for (const b of nav.children) b.classList.toggle("active", b.dataset.view === view);
    page.view = view;
    const sec = sections[view];
    if (!sec.dataset.rendered || sec.dataset.width !== String(main.clientWidth)) {
      sec.replaceChildren();
      if (view === "compare") renderCompare(sec); else perProfile(sec, RENDER[view]);
      sec.dataset.rendered = "1"; sec.dataset.width = String(main.clientWidth);
    }
    page.drawTimes[view] = performance.now() - t0;
    hideTip();
  }
  page.show = (view) => { history.replaceState(null, "", "#" + view); show(view); };

  function fail(error) {
    page.errors.push(String(error && error.stack || error));
    main.prepend(h("div", {class: "alert", text: "The page could not show the profile: " + (error && error.message || error)}));
    console.error(error);
  }

  async function start() {
    document.body.append(header, nav, main, tip);
    if (typeof DecompressionStream === "undefined") throw new Error("this browser has no DecompressionStream (Chrome 80, Firefox 113, Safari 16.4 or later read these pages)");
    const blobs = [...document.querySelectorAll("script.ipusim-profile")];
    const buffers = await Promise.all(blobs.map((b) => inflate(fromBase64(b.textContent))));
    page.profiles = buffers.map((buf, i) => readProfile(buf, i));
    page.timings.decoded = performance.now();
    header.append(h("h1", {text: "ipusim profile"}), ...page.profiles.map((P) => h("div", {class: "who", text: profileTitle(P)})));
    for (const view of PAGE.views) {
      if (view === "compare" && page.profiles.length < 2) continue;
      nav.append(h("button", {type: "button", "data-view": view, text: VIEW_TITLES[view], onclick: () => page.show(view)}));
      sections[view] = h("section", {id: "view-" + view, hidden: true});
      main.append(sections[view]);
    }
    window.addEventListener("hashchange", () => show(location.hash.slice(1)));
    let resizeTimer = null;
    window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => show(page.view), 150); });
    show(location.hash.slice(1) || "summary");
    page.timings.firstDraw = performance.now();
    page.timings.sinceScriptStart = page.timings.firstDraw - T0;
    document.documentElement.dataset.ready = "1";
  }
  window.addEventListener("error", (e) => page.errors.push(String(e.message)));
  page.ready = start().catch((e) => { fail(e); document.documentElement.dataset.ready = "error"; });
})();
