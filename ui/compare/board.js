// The board: the Compare tab's columns, drawn in the browser from the run's token events
// (ui/compare/stream.py). Run by Gradio's HTML component once it is on the page, with `element`
// (the component's box), `props` (its value: the run's document) and `watch` (called when the
// value changes). The document only grows while a run streams: the board reads the lines after
// the last one it read and appends one small element per token; a column is never drawn again.
// What a token's card shows stays in a JS array beside its element. A new run's document (another
// first line) starts the board afresh. Text goes in with textContent; the only HTML taken from
// the server is the Markdown and diff views of finished answers, which it escapes.
const CONFIG = __CONFIG__;
const FORCED = 1, CHOSEN = 2, RESTATE = 4, TRANSITION = 8;
const VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"};
const visible = (t) => (t ? Array.from(t, (c) => VISIBLE[c] || c).join("") : "∅");
const fmt = (x, d) => (x === null || x === undefined ? "—" : x.toFixed(d));
const shade = (c) => {
  if (c === null) return "transparent";
  for (const [bound, color] of CONFIG.bins) if (bound === null || c < bound) return color;
  return "transparent";
};
const make = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

const root = make("div", "fl-board");
const tabs = make("div", "fl-board-tabs");
tabs.setAttribute("role", "tablist");
tabs.setAttribute("aria-label", "columns");
const legend = make("div", "fl-board-legend");
legend.innerHTML = CONFIG.diff_legend;  // static markup of the page's own
const grid = make("div", "fl-board-cols");
root.append(tabs, legend, grid);
element.replaceChildren(root);

const S = {head: "", read: 0, run: null, cols: [], vocab: new Map(), fresh: new Set(), memKeys: [],
           chart: [], mem: [], view: "confidence", shown: 0};

// ---- a column ----
const heading = (info) => {
  const h = make("h3", "fl-heading fl-colhead");
  const dot = make("span", "fl-dot");
  dot.style.background = info.color;
  dot.setAttribute("aria-hidden", "true");
  h.append(dot, make("span", "fl-colname", info.name));
  if (info.strategy) h.append(make("span", "fl-colstrategy", " · " + info.strategy));
  const note = info.strategy ? info.params : "no feedback: the model as it is";
  h.title = info.strategy ? `${info.name} · ${info.strategy} — ${info.params}` : info.name;
  const wrap = make("div", "fl-bhead");
  wrap.append(h, make("span", "fl-note fl-colnote", note));
  if (info.badges.length) {
    const tags = make("div", "fl-badges");
    for (const b of info.badges) tags.append(make("span", "fl-badge", b));
    wrap.append(tags);
  }
  return wrap;
};

const turns = (list) => {
  const box = make("div", list.length ? "fl-turns" : "fl-turns fl-none");
  const labels = {user: "you", assistant: "the model"};
  for (const [role, text, current] of list) {
    if (labels[role]) {
      const b = make("div", `fl-turn fl-${role}` + (current ? " fl-current" : ""), text);
      b.setAttribute("aria-label", labels[role]);
      box.append(b);
    } else {
      box.append(make("div", "fl-turn-note fl-system", `${role}: ${text}`));
    }
  }
  return box;
};

const actions = (n) => {
  const bar = make("div", "fl-col-actions");
  const button = (cls, label, title, data, word) => {
    const b = make("button", cls, label);
    b.type = "button";
    b.title = title;
    Object.assign(b.dataset, data);
    if (word) b.append(make("span", "fl-word", word));
    bar.append(b);
  };
  button("fl-copy", "Copy", "copy this column's answer", {col: `col${n}`}, " answer");
  button("fl-col-act fl-rerun", "Re-run", "run this column again with its settings as they are now; the other " +
         "columns stay", {column: String(n), act: "rerun"});
  button("fl-col-act fl-col-stop", "Stop", "stop this column; the others go on", {column: String(n), act: "stop"},
         " column");
  for (const [verdict, sign] of CONFIG.ratings) {
    button("fl-col-act fl-rate", sign, `rate this column ${verdict}; saved with the run in History (add a note there)`,
           {column: String(n), act: "rate", verdict: verdict}, " " + verdict);
  }
  const wrap = make("div", "fl-bactions");
  wrap.id = `col${n}-actions`;
  wrap.append(bar);
  return wrap;
};

const column = (info, i, live) => {
  const n = i + 1;
  const section = make("section", "fl-bcol");
  section.id = `col${n}`;
  section.setAttribute("aria-label", `column ${n}: ${info.name}`);
  const text = make("div", "fl-btext");
  text.id = `col${n}-text`;
  const box = make("div", "fl-text" + (live ? " fl-live" : ""));
  box.dataset.row = info.name;
  const alt = make("div", "fl-text fl-markdown fl-alt-view");
  alt.hidden = true;
  text.append(box, alt);
  const head = heading(info);
  head.id = `col${n}-title`;
  const talk = turns(info.turns);
  talk.id = `col${n}-turns`;
  section.append(head, talk, text, actions(n));
  const tab = make("button", "fl-board-tab", info.name);
  tab.type = "button";
  tab.setAttribute("role", "tab");
  tab.style.borderColor = info.color;
  tab.addEventListener("click", () => showColumn(i));
  return {i, info, section, box, alt, tab, toks: [], spans: [], ended: !live, md: null, diff: null, divAt: null,
          checked: 0, shownView: null};
};

// ---- a run ----
const start = (info) => {
  S.run = info.id;
  S.fresh = new Set(info.fresh);
  S.memKeys = info.memory || [];
  S.chart = [];
  S.mem = [];
  S.cols = info.columns.map((c, i) => column(c, i, S.fresh.has(i)));
  grid.style.setProperty("--n", String(Math.max(1, S.cols.length)));
  grid.className = `fl-board-cols fl-n${S.cols.length}`;
  grid.replaceChildren(...S.cols.map((c) => c.section));
  tabs.replaceChildren(...S.cols.map((c) => c.tab));
  showColumn(Math.min(S.shown, Math.max(0, S.cols.length - 1)));
  root.dataset.run = S.run;
  delete root.dataset.lagMs;
};

const showColumn = (i) => {
  S.shown = i;
  S.cols.forEach((c, k) => {
    c.section.classList.toggle("fl-shown", k === i);
    c.tab.setAttribute("aria-selected", String(k === i));
  });
};

const marker = () => {
  const m = make("span", "fl-diverge", "differs from here");
  m.title = "the columns differ from here on";
  return m;
};

// Where a column first differs from column 1: once both have reached that step (before, it is a
// prefix). Column 1 is marked at the first step any column differs from it.
const divergence = () => {
  const first = S.cols[0];
  if (!first) return;
  let earliest = null;
  for (const c of S.cols.slice(1)) {
    while (c.divAt === null && c.checked < c.toks.length && c.checked < first.toks.length) {
      if (c.toks[c.checked][3] !== first.toks[c.checked][3]) {
        c.divAt = c.checked;
        c.spans[c.divAt].before(marker());
      }
      c.checked += 1;
    }
    if (c.divAt !== null && (earliest === null || c.divAt < earliest)) earliest = c.divAt;
  }
  if (earliest !== null && earliest !== first.divAt) {
    first.box.querySelector(".fl-diverge")?.remove();
    first.divAt = earliest;
    first.spans[earliest].before(marker());
  }
};

const token = (ev) => {
  const c = S.cols[ev[1]];
  if (!c) return;
  const f = ev[11];
  const s = make("span", "fl-tok" + (f & CHOSEN ? " fl-forced" : f & FORCED ? " fl-replayed" : "") +
                 (f & RESTATE ? " fl-part-restate" : f & TRANSITION ? " fl-part-transition" : ""), ev[4]);
  s.dataset.step = ev[2];
  s.tabIndex = c.toks.length ? -1 : 0;
  s.style.backgroundColor = shade(ev[5]);
  c.toks.push(ev);
  c.spans.push(s);
  c.box.append(s);
  if (S.fresh.has(c.i)) S.chart.push([c.i, ev[2], ev[5], ev[6]]);
};

const end = (ev) => {
  const c = S.cols[ev[1]];
  if (!c) return;
  const keep = ev[4];
  if (c.toks.length > keep) {  // a Stop keeps what the page showed: what came after it goes
    for (const s of c.spans.splice(keep)) s.remove();
    c.toks.length = keep;
    if (c.divAt !== null && c.divAt >= keep) { c.divAt = null; c.checked = keep; }
  }
  c.ended = true;
  c.box.classList.remove("fl-live");
  c.section.classList.add("fl-ended");
};

const apply = (ev) => {
  switch (ev[0]) {
    case "run": start(ev[1]); break;
    case "v": S.vocab.set(ev[1], ev[2]); break;
    case "t": token(ev); break;
    case "end": end(ev); break;
    case "md": if (S.cols[ev[1]]) S.cols[ev[1]].md = ev[2]; break;
    case "diff": if (S.cols[ev[1]]) S.cols[ev[1]].diff = ev[2]; break;
    case "m": S.mem.push(ev.slice(1)); break;
    case "done": root.dataset.lagMs = String(Math.round(Date.now() - 1000 * ev[1])); break;
  }
};

// ---- the views: confidence and plain are the tokens (coloured or not); markdown and diff are a
// finished column's formatted answer, shown as plain tokens until it has one ----
const showView = () => {
  for (const c of S.cols) {
    const html = S.view === "markdown" ? c.md : S.view === "diff" ? c.diff : null;
    const key = html === null ? null : S.view;
    if (key === c.shownView) continue;
    c.shownView = key;
    if (html !== null) {
      c.alt.className = "fl-text fl-alt-view " + (S.view === "markdown" ? "fl-markdown" : "fl-diff");
      c.alt.innerHTML = html;
    } else {
      c.alt.replaceChildren();
    }
    c.alt.hidden = html === null;
    c.box.hidden = html !== null;
  }
  root.className = `fl-board fl-view-${S.view}`;
};

// ---- the charts: the run's points added to the charts the server drew for it (their layout
// names the run); points wait until that chart is on the page ----
const chartOf = (id) => {
  const gd = document.querySelector(`#${id} .js-plotly-plot`);
  return gd && window.Plotly && gd.data && gd.layout && gd.layout.meta && gd.layout.meta.feed === S.run ? gd : null;
};
const extend = (gd, points) => {
  const traces = Array.from(points.keys()).filter((t) => t < gd.data.length);
  if (traces.length) {
    window.Plotly.extendTraces(gd, {x: traces.map((t) => points.get(t).x), y: traces.map((t) => points.get(t).y)},
                               traces);
  }
};
const push = (points, trace, x, y) => {
  if (!points.has(trace)) points.set(trace, {x: [], y: []});
  points.get(trace).x.push(x);
  points.get(trace).y.push(y);
};
// Plotly redraws a chart whole to extend it: at most every CHART_EVERY_MS, with what came meanwhile.
const CHART_EVERY_MS = 500;
let retry = null;
const feedCharts = () => {
  retry = null;
  const conf = S.chart.length ? chartOf("conf-plot") : null;
  if (conf) {
    const points = new Map();
    for (const [c, step, y, group] of S.chart) { push(points, 2 * c, step, y); push(points, 2 * c + 1, step, group); }
    S.chart = [];
    extend(conf, points);
  }
  const mem = S.mem.length ? chartOf("mem-plot") : null;
  if (mem) {
    const points = new Map();
    for (const [t, ...values] of S.mem) values.forEach((v, k) => push(points, k, t, v));
    S.mem = [];
    extend(mem, points);
    const ys = mem.data.flatMap((d) => Array.from(d.y || [])).filter((v) => v !== null && v !== undefined);
    const range = mem.layout.yaxis && mem.layout.yaxis.range;
    if (ys.length && range) {  // the server drew it with a fixed range: widened when a point leaves it
      let lo = Math.min(...ys), hi = Math.max(...ys);
      if (lo < range[0] || hi > range[1]) {
        if (hi - lo < CONFIG.memory_min_span) {
          const mid = (hi + lo) / 2;
          lo = mid - CONFIG.memory_min_span / 2;
          hi = mid + CONFIG.memory_min_span / 2;
        }
        const pad = 0.05 * (hi - lo);
        window.Plotly.relayout(mem, {"yaxis.range": [Math.max(0, lo - pad), hi + pad]});
      }
    }
  }
  if ((S.chart.length || S.mem.length) && S.run) retry = setTimeout(feedCharts, CHART_EVERY_MS);
};

// ---- reading the document ----
const read = () => {
  const doc = typeof props.value === "string" ? props.value : "";
  const first = doc.indexOf("\n") + 1;
  if (!first || !doc.startsWith(S.head) || !S.head) {  // another run (or none): start afresh
    S.head = doc.slice(0, first);
    S.read = 0;
    S.run = null;
    S.cols = [];
    S.vocab = new Map();
    grid.replaceChildren();
    tabs.replaceChildren();
    if (!first) return;
  }
  const whole = doc.lastIndexOf("\n") + 1;  // complete lines only
  if (whole <= S.read) return;
  const lines = doc.slice(S.read, whole).split("\n");
  S.read = whole;
  for (const line of lines) if (line) apply(JSON.parse(line));
  divergence();
  showView();
  if (!retry) retry = setTimeout(feedCharts, CHART_EVERY_MS);
};

// What the page script asks of the board: a token's card, how many tokens a column shows (a Stop
// keeps them), the token view.
window.flBoard = {
  card(el) {
    const sec = el.closest(".fl-bcol");
    const c = sec && S.cols.find((x) => x.section === sec);
    const k = c ? c.spans.indexOf(el) : -1;
    if (k < 0) return null;
    const [, , step, id, text, conf, group, prob, entropy, ids, probs, f] = c.toks[k];
    const rows = [["probability", prob === null ? "—" : (100 * prob).toFixed(1) + "%"], ["confidence", fmt(conf, 2)],
                  ["entropy", fmt(entropy, 2) + " nats"], ["group confidence", fmt(group, 2)], ["step", String(step)]];
    if (f & FORCED) rows.push(f & CHOSEN ? CONFIG.chosen_row : CONFIG.replayed_row);
    if (f & RESTATE) rows.push(CONFIG.part_rows.restate);
    if (f & TRANSITION) rows.push(CONFIG.part_rows.transition);
    const top = ids.map((t, j) => [visible(S.vocab.get(t) ?? ""), probs[j] ?? 0, t === id, t]);
    return {title: visible(text), rows: rows, top: top};
  },
  shown(n) { const c = S.cols[n - 1]; return c ? c.toks.length : 0; },
  steps() { return Math.max(0, ...S.cols.filter((c) => S.fresh.has(c.i)).map((c) => c.toks.length)); },
  view(v) { if (v && v !== S.view) { S.view = v; for (const c of S.cols) c.shownView = undefined; showView(); } },
};
const checked = document.querySelector("#token-view input:checked");
if (checked) S.view = checked.value;

// A phone shows one column at a time: its tab, or a swipe sideways, shows another.
let touch = null;
grid.addEventListener("touchstart", (e) => { touch = e.touches.length === 1 ? e.touches[0].clientX : null; },
                      {passive: true});
grid.addEventListener("touchend", (e) => {
  if (touch === null || !window.matchMedia("(max-width: 700px)").matches) return;
  const dx = e.changedTouches[0].clientX - touch;
  touch = null;
  if (Math.abs(dx) > 60) showColumn(Math.min(S.cols.length - 1, Math.max(0, S.shown + (dx < 0 ? 1 : -1))));
}, {passive: true});

watch("value", read);
read();
