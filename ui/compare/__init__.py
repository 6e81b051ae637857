"""The Compare tab: 2 to 4 columns of one engine run streamed side by side.

- its settings, declared once (control, check, place in a RunConfig): `ui.page.settings` (History,
  Sweep read them);
- `layout`: the components, where they go;
- `view`: what a run shows, as plain data built from engine records;
- `stream`: the columns' token events, the compact append-only text the page's board reads;
- `board.js`: the board, the one component that draws the columns in the browser (its CSS is the
  page's, `ui.page.theme`);
- `work`: a run streamed from the engine (first turn, follow-up, branch, one column again) and Calibrate;
- `link`: a setup packed into (and validated out of) a shareable page address;
- it records each run in this browser's history, `ui.page.history` (the History tab lists them);
- `tab`: the handlers and their wiring.
"""
