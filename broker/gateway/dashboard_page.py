"""The dashboard's one HTML page: plain markup, inline CSS and a small inline script that renders
``/dashboard/data`` every two seconds. No build step and no CDN (fleets run on offline machines).

Every value reaches the page through ``textContent``, never as markup: session ids and error
reasons come from clients and workers."""

from __future__ import annotations

import json
from typing import Any

REFRESH_MS = 2000

_STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse} td,th{border-bottom:1px solid #ddd;padding:.25em .7em;text-align:left}
th{background:#f4f4f4} .tiles{display:flex;gap:1em;flex-wrap:wrap}
.tile{border:1px solid #ccc;border-radius:6px;padding:.5em 1em;min-width:8em}
.tile b{display:block;font-size:1.5em} .bad{color:#b00020;font-weight:600} .ok{color:#08660d}
#status{color:#666} button{cursor:pointer}
"""

_SCRIPT = """
const REFRESH_MS = %(refresh)d;
const text = (v) => (v === null || v === undefined || v === '') ? '-' : String(v);
function row(cells, header) {
  const tr = document.createElement('tr');
  for (const c of cells) {
    const td = document.createElement(header ? 'th' : 'td');
    if (c instanceof Node) td.appendChild(c); else td.textContent = text(c);
    tr.appendChild(td);
  }
  return tr;
}
function fill(id, header, rows) {
  const table = document.getElementById(id);
  table.replaceChildren(row(header, true), ...rows.map((r) => row(r, false)));
}
function flag(ok, yes, no) {
  const span = document.createElement('span');
  span.className = ok ? 'ok' : 'bad'; span.textContent = ok ? yes : no; return span;
}
function setTile(id, value) { document.getElementById(id).textContent = text(value); }
async function replay(entryId, button) {
  button.disabled = true;
  const r = await fetch('dashboard/replay/' + encodeURIComponent(entryId),
                        {method: 'POST', credentials: 'same-origin'});
  const body = await r.json().catch(() => ({}));
  document.getElementById('replay-result').textContent =
    entryId + ': ' + text(body.status || (body.error && body.error.message)) + ' ' + text(body.message);
  await refresh();
}
function replayButton(d) {
  if (!d.replayable) return 'not replayable';
  const b = document.createElement('button');
  b.textContent = 'replay'; b.className = 'replay'; b.dataset.entry = d.entry_id;
  b.onclick = () => replay(d.entry_id, b); return b;
}
function render(data) {
  const s = data.stats;
  setTile('steps-per-s', s.steps_per_s); setTile('committed-window', s.committed);
  setTile('failed-window', s.failed); setTile('p50', s.p50_ms); setTile('p99', s.p99_ms);
  setTile('committed-total', data.committed_total); setTile('dead-total', data.dead_letters.total);
  setTile('failover-count', s.failovers.length);
  setTile('window', Math.round(s.window_s / 60));
  fill('workers', ['worker', 'live', 'state', 'engine', 'engine ready', 'models', 'load', 'policy version',
                   'committed', 'weights error'],
       data.workers.map((w) => [w.worker_id, flag(w.live, 'yes', 'NO'), w.state, w.engine,
                                flag(w.engine_ready, 'ready', 'NOT READY'), w.models,
                                text(w.load) + ' / ' + text(w.capacity), w.policy_version,
                                w.committed_steps, w.weights_error]));
  const ss = data.sessions;
  fill('sessions', ['total', 'busy', 'idle', 'orphaned', 'sampled'],
       [[ss.total, ss.busy, ss.idle, ss.orphaned, ss.sampled]]);
  fill('dead', ['entry', 'session', 'step', 'code', 'attempts', 'reason', ''],
       data.dead_letters.shown.map((d) => [d.entry_id, d.session_id, d.step_id, d.code, d.attempts, d.reason,
                                          replayButton(d)]));
  fill('failovers', ['at', 'worker', 'sessions moved', 'jobs moved', 'reason'],
       s.failovers.slice().reverse().map((f) => [new Date(f.at_ms).toLocaleTimeString(), f.worker_id,
                                                  f.moved, f.jobs, f.reason]));
  document.getElementById('status').textContent = 'updated ' + new Date().toLocaleTimeString();
}
async function refresh() {
  try {
    const r = await fetch('dashboard/data', {credentials: 'same-origin'});
    if (!r.ok) throw new Error('HTTP ' + r.status);
    render(await r.json());
  } catch (e) {
    document.getElementById('status').textContent = 'refresh failed: ' + e.message;
  }
}
// A key given as ?key= is now a cookie: take it out of the address bar (and of the history).
if (location.search.includes('key=')) history.replaceState(null, '', location.pathname);
render(JSON.parse(document.getElementById('initial').textContent));
setInterval(refresh, REFRESH_MS);
"""

_BODY = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Rollout Fleet dashboard</title>
<style>%(style)s</style></head>
<body>
<h1>Rollout Fleet: %(cell)s</h1><div id="status">loading</div>
<div class="tiles">
 <div class="tile">steps/s (last minute)<b id="steps-per-s"></b></div>
 <div class="tile">committed (window)<b id="committed-window"></b></div>
 <div class="tile">failed (window)<b id="failed-window"></b></div>
 <div class="tile">p50 ms<b id="p50"></b></div>
 <div class="tile">p99 ms<b id="p99"></b></div>
 <div class="tile">committed by registered workers<b id="committed-total"></b></div>
 <div class="tile">dead letters<b id="dead-total"></b></div>
 <div class="tile">failovers (window)<b id="failover-count"></b></div>
</div>
<p>Rates, latencies (enqueue to commit) and failovers over the last <span id="window"></span> minutes.</p>
<h2>Workers</h2><table id="workers"></table>
<h2>Sessions</h2><table id="sessions"></table>
<h2>Dead letters</h2><div id="replay-result"></div><table id="dead"></table>
<h2>Failovers</h2><table id="failovers"></table>
<script type="application/json" id="initial">%(initial)s</script>
<script>%(script)s</script>
</body></html>
"""


def render_page(cell: str, initial: dict[str, Any]) -> str:
    """The page with its first data inline (it shows at once; the script refreshes it). ``cell``:
    what the page covers, as its title says it ("cell 0", "every cell")."""
    # "</" cannot close the JSON's script element early: JSON allows "<\\/" for "</".
    data = json.dumps(initial).replace("</", "<\\/")
    cell_text = cell.replace("&", "&amp;").replace("<", "&lt;")
    return _BODY % {"style": _STYLE, "cell": cell_text, "initial": data,
                    "script": _SCRIPT % {"refresh": REFRESH_MS}}
