"""Page-wide CSS and the small script behind token detail cards and idle polling.

Both go to `launch()` (Gradio 6 takes `css` and `head` there): use `launch_kwargs()`.
Colours use Gradio's theme variables, so light and dark themes both read well; charts are drawn
with transparent backgrounds and get their text and grid colours here.
"""

from __future__ import annotations

from feedback.serve.limits import UPLOAD_MAX_BYTES

CSS = """
/* ---- generated text ---- */
.fl-text { white-space: pre-wrap; word-break: break-word; line-height: 1.65; min-height: 3em;
  color: var(--body-text-color); font-family: var(--font-mono, ui-monospace, monospace); font-size: 0.92em; }
.fl-empty { color: var(--body-text-color-subdued); font-style: italic; }
/* the markdown view: prose in the body font; code and tables scroll inside the column on a phone */
.fl-text.fl-markdown { white-space: normal; font-family: var(--font); font-size: 0.95em; }
.fl-markdown p, .fl-markdown ul, .fl-markdown ol, .fl-markdown pre, .fl-markdown table { margin: 0 0 0.6em; }
.fl-markdown ul, .fl-markdown ol { padding-left: 1.4em; }
.fl-markdown code { font-family: var(--font-mono, ui-monospace, monospace); font-size: 0.92em;
  background: var(--background-fill-secondary); border-radius: 3px; padding: 0 3px; }
.fl-markdown pre { overflow-x: auto; background: var(--background-fill-secondary); border-radius: 6px;\
 padding: 8px; }
.fl-markdown pre code { padding: 0; background: none; white-space: pre; }
.fl-markdown table { display: block; overflow-x: auto; border-collapse: collapse; }
.fl-markdown th, .fl-markdown td { border: 1px solid var(--border-color-primary); padding: 2px 6px; }
.fl-tok { border-radius: 3px; padding: 0 1px; cursor: pointer; }
.fl-tok:hover, .fl-tok:focus, .fl-tok.fl-active { outline: 2px solid var(--color-accent); outline-offset: 0; }
.fl-tok.fl-first { color: var(--body-text-color-subdued); }
/* a streaming text's cursor, after its last token (the box stays open while it streams) */
.fl-text.fl-live::after { content: ""; display: inline-block; width: 0.5em; height: 1.1em;\
 vertical-align: text-bottom;
  background: var(--body-text-color); animation: fl-blink 1s step-end infinite; }
@keyframes fl-blink { 50% { opacity: 0; } }
.fl-diverge { display: inline-block; font-size: 0.72em; font-family: var(--font); font-weight: 600;
  line-height: 1.2; padding: 0 4px; margin: 0 2px; border-radius: 3px; vertical-align: 1px;
  color: var(--body-text-color); border: 1px dashed var(--body-text-color-subdued); }
.fl-diverge ~ .fl-tok, .fl-diverge ~ .fl-plain { text-decoration: underline dotted\
 var(--body-text-color-subdued);
  text-underline-offset: 3px; }
/* ---- the metrics table ---- */
.fl-stats { border-collapse: collapse; width: 100%; font-size: 0.88em; border: none !important; margin: 0; }
.fl-stats tr, .fl-stats th, .fl-stats td { border: none !important; background: transparent !important; }
.fl-stats th, .fl-stats td { padding: 2px 6px; text-align: left;
  border-bottom: 1px solid var(--border-color-primary) !important; }
.fl-stats th { font-weight: 500; color: var(--body-text-color); opacity: 0.8; }
.fl-stats td { font-variant-numeric: tabular-nums; color: var(--body-text-color); }
/* the metrics table: a metric per row, a column per column; on a phone it scrolls sideways */
.fl-metrics { overflow-x: auto; }
.fl-metrics thead th { font-weight: 600; opacity: 1; white-space: nowrap; }
.fl-metrics tbody th { white-space: nowrap; }
/* a read-only data table (History): scrolls in its box both ways, its header kept in view */
.fl-table { max-height: 32rem; overflow: auto; border: 1px solid var(--border-color-primary);
  border-radius: var(--radius-md, 6px); }
.fl-table table { border-collapse: collapse; width: 100%; font-size: 0.85em; margin: 0;\
 border: none !important; }
.fl-table th, .fl-table td { padding: 4px 8px; text-align: left; vertical-align: top;
  border: none !important; border-bottom: 1px solid var(--border-color-primary) !important;
  color: var(--body-text-color); overflow-wrap: anywhere; }
.fl-table thead th { position: sticky; top: 0; z-index: 1; font-weight: 600; white-space: nowrap;
  background: var(--background-fill-secondary) !important; }
.fl-table tbody tr:nth-child(even) td { background: var(--table-odd-background-fill, transparent); }
.fl-history td { min-width: 7rem; max-width: 22rem; }
.fl-history td:nth-child(2), .fl-history td:nth-child(3) { min-width: 0; white-space: nowrap; }
.fl-table-empty { color: var(--body-text-color-subdued) !important; font-style: italic; }
.fl-ok { color: var(--color-green-600, #1a7f37); font-weight: 600; }
.fl-bad { color: var(--color-red-600, #c4320a); font-weight: 600; }
.dark .fl-ok { color: #5cc77a; } .dark .fl-bad { color: #ff8a65; }
/* ---- legends and notes ---- */
.fl-legend { display: flex; flex-wrap: wrap; gap: 4px 10px; align-items: center; font-size: 0.85em;
  color: var(--body-text-color); }
.fl-swatch { display: inline-block; width: 1.1em; height: 1.1em; border-radius: 3px; vertical-align: -3px;
  margin-right: 3px; border: 1px solid var(--border-color-primary); }
.fl-note { font-size: 0.88em; color: var(--body-text-color); opacity: 0.85; }
.fl-status { font-size: 0.95em; }
.fl-status.fl-wait { font-weight: 600; }
.fl-status.fl-wait::before { content: ""; display: inline-block; width: 0.6em; height: 0.6em;\
 border-radius: 50%;
  margin-right: 0.45em; background: var(--color-accent); animation: fl-blink 1s step-end infinite; }
.fl-status.fl-error { color: var(--error-text-color, #b91c1c); }
/* Help under controls: Gradio's default grey is 1.9:1 on white; this is ~7:1 in both themes. */
.gradio-container .info-text, .gradio-container [data-testid="block-info"] {
  color: var(--body-text-color) !important; opacity: 0.78; }
/* ---- token detail card (one element, filled by the script below) ---- */
#fl-card { position: fixed; z-index: 1000; display: none; max-width: min(340px, 92vw); padding: 8px 10px;
  border-radius: 8px; font-size: 13px; line-height: 1.4; pointer-events: none;
  background: var(--background-fill-primary, #fff); color: var(--body-text-color, #111);
  border: 1px solid var(--border-color-primary, #ccc); box-shadow: 0 6px 20px rgba(0,0,0,0.25); }
#fl-card.fl-open { display: block; }
#fl-card .fl-card-title { font-family: var(--font-mono, monospace); font-weight: 700; margin-bottom: 4px;
  word-break: break-all; }
#fl-card table { border-collapse: collapse; width: 100%; margin: 0; }
#fl-card td { padding: 1px 4px; border: none; font-variant-numeric: tabular-nums; }
#fl-card td:first-child { opacity: 0.8; }
#fl-card .fl-alt { display: flex; align-items: center; gap: 6px; font-family: var(--font-mono, monospace); }
#fl-card .fl-alt-bar { height: 6px; border-radius: 3px; background: var(--color-accent, #f97316); }
#fl-card .fl-alt-text { min-width: 6em; white-space: pre; overflow: hidden; text-overflow: ellipsis; }
#fl-card .fl-alt.fl-chosen { font-weight: 700; }
#fl-card.fl-pinned { pointer-events: auto; }
#fl-card button.fl-alt { width: 100%; background: transparent; border: 1px solid transparent;\
 border-radius: 4px;
  color: inherit; cursor: pointer; padding: 1px 2px; text-align: left; font: inherit; }
#fl-card button.fl-alt:hover, #fl-card button.fl-alt:focus { border-color: var(--color-accent, #f97316); }
#fl-card .fl-card-hint { margin-top: 4px; font-size: 12px; opacity: 0.8; }
/* ---- forced tokens, diff marks, best values, column headings, conversations ---- */
.fl-tok.fl-forced { box-shadow: inset 0 -2px 0 var(--color-accent); }
.fl-tok.fl-replayed { box-shadow: inset 0 -1px 0 var(--body-text-color-subdued); }
.fl-tok.fl-part-restate { font-style: italic; opacity: 0.8; }
.fl-tok.fl-part-transition { font-weight: 600; text-decoration: underline dotted; }
mark.fl-ins { background: rgba(0, 158, 115, 0.25); color: var(--body-text-color); border-radius: 2px;\
 padding: 0 1px; }
.dark mark.fl-ins { background: rgba(0, 158, 115, 0.4); }
del.fl-del { font-size: 0.8em; color: var(--body-text-color-subdued); margin-right: 0.25em; }
td.fl-best { font-weight: 700; }
.fl-star { color: var(--color-accent); }
.fl-heading { font-size: var(--text-xl); font-weight: 600; margin: 0 0 2px; line-height: 1.3;
  color: var(--body-text-color); overflow-wrap: anywhere; }
.fl-heading.fl-colhead { font-size: var(--text-lg); }
.fl-note.fl-colnote { display: block; line-height: 1.35; overflow-wrap: anywhere; }
@media (max-width: 640px) { .fl-heading.fl-colhead { font-size: var(--text-lg); } }
.fl-dot { display: inline-block; width: 0.7em; height: 0.7em; border-radius: 50%; margin-right: 0.35em;
  vertical-align: 0.05em; }
.fl-badge { display: inline-block; font-size: 0.6em; font-weight: 500; padding: 1px 6px; margin-left: 4px;
  border: 1px solid var(--color-accent); border-radius: 999px; vertical-align: 0.2em; }
.fl-turns { display: flex; flex-direction: column; gap: 6px; margin-bottom: 8px; }
.fl-turn { white-space: pre-wrap; word-break: break-word; padding: 6px 10px; border-radius: 10px;\
 max-width: 85%;
  font-size: 0.9em; color: var(--body-text-color); }
.fl-turn.fl-user { align-self: flex-end; background: rgba(0, 114, 178, 0.14); }
.fl-turn.fl-assistant { align-self: flex-start; background: var(--background-fill-secondary); }
.fl-turn.fl-current { border: 1px solid rgba(0, 114, 178, 0.5); }
.fl-turn-note.fl-system { font-size: 0.82em; font-style: italic; text-align: center; opacity: 0.8; }
/* ---- the board: the columns side by side; their headings, conversations, texts and buttons each
   share a row, so the texts start at the same height whatever the headings hold ---- */
.fl-board-cols { display: grid; grid-template-columns: repeat(var(--n, 2), minmax(0, 1fr));
  grid-template-rows: auto auto 1fr auto; column-gap: 14px; }
.fl-bcol { display: grid; grid-row: 1 / span 4; grid-template-rows: subgrid; min-width: 0; }
.fl-bhead { border-bottom: 2px solid var(--border-color-primary); margin-bottom: 6px; padding-bottom: 2px; }
.fl-badges { display: flex; flex-wrap: wrap; gap: 2px 0; margin-top: 2px; }
.fl-badges .fl-badge { margin-left: 0; margin-right: 4px; font-size: 0.75em; }
.fl-turns.fl-none { display: none; }
.fl-n3 .fl-word, .fl-n4 .fl-word { display: none; }  /* three or four columns: the buttons keep their sign */
.fl-board-cols:empty::before {\
 content: "The columns show here when you Generate (set them up under Settings, Columns).";
  color: var(--body-text-color-subdued); font-style: italic; }
.fl-board-tabs, .fl-board-legend { display: none; }
.fl-view-diff .fl-board-legend { display: block; margin-bottom: 6px; }
.fl-view-plain .fl-tok { background: none !important; cursor: text; }
.fl-view-plain .fl-tok:hover { outline: none; }
.fl-text:empty::before { content: "…"; color: var(--body-text-color-subdued); font-style: italic; }
/* a phone shows one column at a time, chosen by its tab (or a swipe) */
@media (max-width: 700px) {
  #view-row { flex-wrap: wrap !important; }  /* the token views, then the colour legend under them */
  #view-row > * { flex: 1 1 100% !important; min-width: 100% !important; }
  .fl-board-tabs { display: flex; gap: 4px; overflow-x: auto; margin-bottom: 6px; }
  .fl-board-tab { flex: 0 0 auto; max-width: 60vw; overflow: hidden; text-overflow: ellipsis;\
 white-space: nowrap;
    padding: 4px 10px; border-radius: 999px; border: 2px solid var(--border-color-primary); font-size: 0.85em;
    background: var(--background-fill-secondary); color: var(--body-text-color); cursor: pointer; }
  .fl-board-tab[aria-selected="true"] { font-weight: 700; background: var(--background-fill-primary); }
  .fl-board-cols { grid-template-columns: minmax(0, 1fr); }
  .fl-bcol:not(.fl-shown) { display: none; }
}
@media (max-width: 640px) {
  .fl-text { font-size: 0.85em; line-height: 1.5; }
  .fl-stats { font-size: 0.78em; }
  .fl-word { display: none; }  /* the column buttons keep their sign or first word on a phone */
  .fl-col-actions { gap: 4px; }
  .fl-copy, .fl-col-act { padding: 2px 7px; }
  .fl-stats th, .fl-stats td { padding: 1px 3px; }
}
.fl-hidden { display: none !important; }
.fl-skip { position: absolute; left: -9999px; }
.fl-col-actions { display: flex; flex-wrap: wrap; gap: 6px; }
.fl-copy, .fl-col-act { font-size: 0.8em; padding: 2px 10px; margin: 2px 0 4px; border-radius: 6px;\
 cursor: pointer;
  border: 1px solid var(--border-color-primary); background: var(--background-fill-secondary);
  color: var(--body-text-color); }
/* Re-run while the Compare tab is idle, Stop column while it runs (its Generate/Stop buttons say which) */
body:has(#generate:disabled) :is(.fl-rerun, .fl-rate), body:has(#stop:enabled) :is(.fl-rerun, .fl-rate) {
  display: none; }
body:has(#stop:disabled) .fl-col-stop { display: none; }
.fl-skip:focus { position: static; display: inline-block; padding: 4px 8px;\
 border: 2px solid var(--color-accent);
  border-radius: 6px; color: var(--body-text-color); }
/* ---- charts: transparent figures take the theme's text and grid colours ---- */
.js-plotly-plot .main-svg .gtitle, .js-plotly-plot .main-svg .xtitle, .js-plotly-plot .main-svg .ytitle,
.js-plotly-plot .main-svg .xtick text, .js-plotly-plot .main-svg .ytick text,
.js-plotly-plot .main-svg .legendtext, .js-plotly-plot .main-svg .annotation-text,
.js-plotly-plot .main-svg .cbtitle, .js-plotly-plot .main-svg .cbaxis text {
  fill: var(--body-text-color) !important; }
.dark .js-plotly-plot .main-svg .gridlayer path, .dark .js-plotly-plot .main-svg .zerolinelayer path {
  stroke: rgba(255,255,255,0.14) !important; }
.dark .js-plotly-plot .modebar-btn path { fill: rgba(255,255,255,0.6) !important; }
"""

# Token cards: hover (mouse), focus (keyboard: Tab to a column's first token, then arrow keys) and
# tap (touch) open one card with the token's numbers; Escape or a tap elsewhere closes it. The data
# sits in each token's data-card attribute as JSON; text goes in with textContent, never as HTML.
# A card opened by a click, tap or focus on a finished column offers its alternatives as buttons:
# picking one writes {row, step, token_id} into a hidden textbox and presses a hidden button, which
# runs the branch on the server.
# Idle polling: a hidden checkbox mirrors the page's visibility so the memory timer stops when hidden.
HEAD = """
<script>
(() => {
  let card = null, pinned = null, shown = null;
  const ensure = () => {
    if (!card) { card = document.createElement("div"); card.id = "fl-card"; card.setAttribute("role",\
 "tooltip");
                 document.body.appendChild(card); }
    return card;
  };
  const row = (table, label, value) => {
    const tr = table.insertRow(); tr.insertCell().textContent = label; tr.insertCell().textContent = value;
  };
  // a token's card: its data-card attribute (the Perplexity tab's), or the Compare board's arrays
  const cardOf = (el) => {
    if (el.dataset.card === undefined) return window.flBoard ? window.flBoard.card(el) : null;
    try { return JSON.parse(el.dataset.card); } catch (e) { return null; }
  };
  const fill = (el) => {
    const d = cardOf(el);
    if (!d) return false;
    const c = ensure(); c.replaceChildren();
    const title = document.createElement("div"); title.className = "fl-card-title";\
 title.textContent = d.title;
    c.appendChild(title);
    const table = document.createElement("table");
    for (const [k, v] of d.rows || []) row(table, k, v);
    c.appendChild(table);
    if (d.top && d.top.length) {
      const head = document.createElement("div"); head.textContent = d.top_label || "top-5 next tokens";
      head.style.margin = "4px 0 2px"; head.style.opacity = "0.8"; c.appendChild(head);
      const where = branchable(el);
      for (const [text, p, chosen, tokenId] of d.top) {
        const canBranch = where && !chosen && Number.isInteger(tokenId);
        const line = document.createElement(canBranch ? "button" : "div");
        line.className = "fl-alt" + (chosen ? " fl-chosen" : "");
        if (canBranch) {
          line.type = "button";
          line.title = "force this token here and continue (a branch)";
          line.addEventListener("click", (ev) => {
            ev.stopPropagation();\
 branchTo(where.row, where.step, tokenId, ev.detail === 0);  // 0: Enter or Space
          });
        }
        const t = document.createElement("span"); t.className = "fl-alt-text"; t.textContent = text;
        const bar = document.createElement("span"); bar.className = "fl-alt-bar";
        bar.style.width = Math.max(2, Math.round(p * 90)) + "px";
        const pct = document.createElement("span"); pct.textContent = (100 * p).toFixed(1) + "%";
        line.append(t, bar, pct); c.appendChild(line);
      }
      const box = el.closest(".fl-text[data-row]");
      const finished = box && !box.classList.contains("fl-live") && el.dataset.step !== undefined;
      if (where || finished) {
        const hint = document.createElement("div"); hint.className = "fl-card-hint";
        hint.textContent = where ? "click an alternative (or ↓ then Enter) to branch from here"
                                 : "click the token to branch from one of these";
        c.appendChild(hint);
      }
    }
    return true;
  };
  const place = (el) => {
    const c = ensure(), r = el.getBoundingClientRect(), w = c.offsetWidth, h = c.offsetHeight;
    let x = Math.min(Math.max(6, r.left), window.innerWidth - w - 6);
    let y = r.bottom + 6;
    if (y + h > window.innerHeight - 6) y = Math.max(6, r.top - h - 6);
    c.style.left = x + "px"; c.style.top = y + "px";
  };
  const open = (el) => {
    if (!fill(el)) return;
    ensure().classList.toggle("fl-pinned", pinned === el);
    document.querySelectorAll(".fl-tok.fl-active").forEach((t) => t.classList.remove("fl-active"));
    el.classList.add("fl-active");
    ensure().classList.add("fl-open"); place(el); shown = el;
  };
  const close = () => {
    if (card) card.classList.remove("fl-open", "fl-pinned");
    document.querySelectorAll(".fl-tok.fl-active").forEach((t) => t.classList.remove("fl-active"));
    pinned = null; shown = null;
  };
  // A branch: only from a pinned card of a finished column (no caret) that names its column.
  const branchable = (el) => {
    const box = el.closest(".fl-text[data-row]");
    if (!pinned || pinned !== el || !box || box.classList.contains("fl-live")\
 || el.dataset.step === undefined) return null;
    return {row: box.dataset.row, step: parseInt(el.dataset.step, 10)};
  };
  // After a branch made from the keyboard, focus goes back to the branched token once its column
  // has streamed and finished (the text is drawn anew while it streams).
  let refocus = null;
  const restoreFocus = () => {
    if (!refocus) return;
    const box = Array.from(document.querySelectorAll(".fl-text[data-row]")).find((b) =>\
 b.dataset.row === refocus.row);
    if (!box) return;
    if (box.classList.contains("fl-live")) { refocus.streamed = true; return; }
    if (!refocus.streamed) return;  // still the text from before the branch
    const t = box.querySelector(`.fl-tok[data-step="${refocus.step}"]`);
    refocus = null;
    if (t) t.focus();
  };
  const branchTo = (row, step, tokenId, keyboard) => {
    refocus = keyboard ? {row: row, step: step, streamed: false} : null;
    const go = document.querySelector("#fl-branch-go");
    if (!go) return;
    // the branch event reads its request from here (ui.compare.tab.page_request), not from a box
    window.flRequest = Object.assign(window.flRequest || {},\
 {branch: JSON.stringify({row: row, step: step, token_id: tokenId})});
    close();
    go.click();
  };
  // a token with a card: the Perplexity tab's, or the board's (not in its plain view)
  const tok = (e) => {
    const t = e.target && e.target.closest ? e.target.closest(".fl-tok[data-card], .fl-board .fl-tok") : null;
    return t && !t.closest(".fl-view-plain") ? t : null;
  };
  document.addEventListener("mouseover", (e) => { const t = tok(e); if (t && !pinned) open(t); });
  document.addEventListener("mouseout", (e) => { const t = tok(e); if (t && !pinned) close(); });
  document.addEventListener("focusin", (e) => { const t = tok(e); if (t) { pinned = t; open(t); } });
  document.addEventListener("click", (e) => {
    if (card && card.contains(e.target)) return;  // a click inside the card (an alternative) keeps it
    const t = tok(e);
    if (t) { pinned = t; open(t); } else if (pinned || (card && card.classList.contains("fl-open"))) close();
  });
  document.addEventListener("keydown", (e) => {
    const inCard = card && card.contains(e.target);
    if (e.key === "Escape") {
      const back = inCard ? pinned : null;
      close();
      if (back) back.focus();
      return;
    }
    // Keyboard branching: ArrowDown from a token moves into its card's alternatives, the arrows
    // move between them, Enter or Space picks one (a button), Escape goes back to the token.
    const buttons = card ? Array.from(card.querySelectorAll("button.fl-alt")) : [];
    if (inCard && ["ArrowDown", "ArrowUp"].includes(e.key) && buttons.length) {
      const k = buttons.indexOf(e.target) + (e.key === "ArrowDown" ? 1 : -1);
      e.preventDefault();
      if (k < 0 && pinned) { pinned.focus(); } else if (buttons[k]) { buttons[k].focus(); }
      return;
    }
    const t = tok(e);
    if (t && e.key === "ArrowDown" && pinned === t && buttons.length) {
      e.preventDefault(); buttons[0].focus(); return;
    }
    if (!t || !["ArrowRight", "ArrowLeft", "Home", "End"].includes(e.key)) return;
    const all = Array.from(t.parentElement.querySelectorAll(".fl-tok"));
    const i = all.indexOf(t);
    const j = e.key === "ArrowRight" ? i + 1 : e.key === "ArrowLeft" ? i - 1 :\
 e.key === "Home" ? 0 : all.length - 1;
    if (all[j]) { e.preventDefault(); all[j].focus(); }
  });
  window.addEventListener("scroll", () => { if (shown && document.contains(shown)) place(shown); }, true);
  // The skip link: focus column 1's first token (which opens its card), or the columns if none yet.
  document.addEventListener("click", (e) => {
    const link = e.target.closest ? e.target.closest("a.fl-skip") : null;
    if (!link) return;
    e.preventDefault(); e.stopImmediatePropagation();  // a click off the tokens would close the card
    const first = document.querySelector("#col1-text .fl-tok[tabindex='0']");
    if (first) first.focus(); else document.querySelector("#columns")?.scrollIntoView();
  }, true);
  // Re-run, stop or rate one column: its number (and verdict) is left for the event, then the hidden
  // button of that action is clicked.
  document.addEventListener("click", (e) => {
    const button = e.target.closest ? e.target.closest("button.fl-col-act") : null;
    if (!button) return;
    const go = document.querySelector({stop: "#fl-stop-go", rate: "#fl-rate-go"}[button.dataset.act] ||\
 "#fl-rerun-go");
    if (!go) return;
    // a rating sends its verdict; a column's Stop the tokens the board shows of it (what it keeps)
    const n = button.dataset.column;
    const column = button.dataset.act === "rate" ? `${n} ${button.dataset.verdict}`
                 : button.dataset.act === "stop" && window.flBoard\
 ? `${n} ${window.flBoard.shown(Number(n))}` : n;
    window.flRequest = Object.assign(window.flRequest || {}, {column: column});\
  // read by the event (page_request)
    go.click();
  });
  // Copy answer: the column's text as plain text (the "differs from here" marker left out).
  document.addEventListener("click", (e) => {
    const button = e.target.closest ? e.target.closest("button.fl-copy") : null;
    if (!button) return;
    const box = document.querySelector(`#${button.dataset.col}-text .fl-text`);
    if (!box) return;
    const copy = box.cloneNode(true);
    copy.querySelectorAll(".fl-diverge, del.fl-del").forEach((x) => x.remove());
    const text = copy.textContent.replace(/^…$/, "");
    // its label's nodes, kept once (a second click meanwhile must not keep "Copied" as the label)
    button.flLabel = button.flLabel || Array.from(button.childNodes, (n) => n.cloneNode(true));
    const done = (said) => {
      button.textContent = said;
      setTimeout(() => button.replaceChildren(...button.flLabel.map((n) => n.cloneNode(true))), 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(() => done("Copied"), () => done("Copy failed"));
    } else { done("Copy needs https"); }
  });
  // In the Compare prompt Enter runs and Shift+Enter starts a new line, as in the follow-up box
  // (Gradio's multi-line box does the reverse). Caught before Gradio's own key handler sees it.
  window.addEventListener("keypress", (e) => {
    if (e.key !== "Enter" || e.isComposing || !e.target.closest || !e.target.closest("#prompt textarea"))\
 return;
    e.stopImmediatePropagation();  // Gradio's handler would submit on Shift+Enter
    if (e.shiftKey) return;  // the browser inserts the new line
    e.preventDefault();
    const run = document.querySelector("#generate");
    if (run && !run.disabled) run.click();
  }, true);
  // After a branch made from the keyboard, focus goes back to the branched token (see restoreFocus).
  new MutationObserver(() => { if (refocus) requestAnimationFrame(restoreFocus); })
    .observe(document.body, {childList: true, subtree: true});
  // Gradio's Plot draws each new figure into a new element and drops the old one without
  // Plotly.purge: the old chart's window resize handler (responsive charts) kept its whole SVG,
  // data and listeners alive, ~900 DOM nodes a Compare run. A chart that leaves the page loses
  // that handler (a whole purge would break the redraws Gradio still has queued on it).
  const release = (node) => {
    if (node.nodeType !== 1) return;
    const charts = node.classList.contains("js-plotly-plot") ? [node] :\
 node.querySelectorAll(".js-plotly-plot");
    for (const gd of charts) {
      if (gd.isConnected || !gd._responsiveChartHandler) continue;
      window.removeEventListener("resize", gd._responsiveChartHandler);
      delete gd._responsiveChartHandler;
    }
  };
  new MutationObserver((records) => {
    for (const r of records) for (const node of r.removedNodes) release(node);
  }).observe(document.body, {childList: true, subtree: true});
  // Idle memory polling only while the page is visible: mirror visibility into a hidden checkbox.
  const sync = () => {
    const box = document.querySelector("#fl-page-visible input[type=checkbox]");
    if (box && box.checked === document.hidden) box.click();
  };
  document.addEventListener("visibilitychange", sync);
})();
</script>
"""


# Gradio refuses larger uploads itself, before writing anything to disk
UPLOAD_MAX = f"{UPLOAD_MAX_BYTES // 1_000_000}mb"


def launch_kwargs() -> dict:
    """What `Blocks.launch()` needs besides host and port: the page's CSS and script, the upload
    size limit, and no Gradio run history: Gradio would keep every call's inputs and outputs in the
    browser's storage (each run's JSON of every token, about 0.7 MB a 4-column, 64-token run,
    measured), which the History tab already keeps, packed and capped."""
    return {"css": CSS, "head": HEAD, "max_file_size": UPLOAD_MAX, "run_history": False}
