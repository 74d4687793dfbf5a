"""report.html: one self-contained page comparing one or more candidates' REPORTs.

A page written alone (``compare --out``, ``report``) is a single file: plotly.js is inlined
once, the figures and every number derived from tokens.parquet travel as JSON inside the
page, and a Content-Security-Policy meta tag forbids the browser from fetching anything at
all (no CDN, no fonts, no images), so the file can be mailed, archived or opened offline and
always shows the same thing. The pages of a RUN (``logitdiff run``: OUT/report.html and one
per candidate) share one OUT/plotly.min.js instead (``plotly_src``, a path relative to the
page), so a RUN of eight pages carries plotly once, not eight times; their policy allows
scripts from that file's own place (file: or the serving origin) and nothing else, and a
page whose shared file is missing says so in a visible line.

Rules the page follows:

* Every number in the candidate matrix is read from report.json (or the run's
  summary.json for the cross-engine floor); the embedded ``logitdiff-data`` JSON records,
  for each matrix cell, the value and the report.json path it came from, so a test (or a
  suspicious reader) can check it.
* Numbers computed here from tokens.parquet (KL CDF, reference-confidence buckets, worst
  items, paired item statistics, Pareto frontier) are also in ``logitdiff-data``.
* Reports are only put side by side when they measure the same thing: the same report
  schema, the same workload (item ids, reference tokenizer, teacher tokens) and the same
  method (full vocabulary, or top-K with the same K). Anything else is refused with a
  :class:`LogitdiffError` naming both report directories and the field; make one page per
  method instead. (Separate matrices for mixed methods would still invite comparing
  numbers across them, and the plots share axes, so refusing is the honest choice.)
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .._version import __version__
from ..contracts import (REPORT_SCHEMA_1, GateResult, MethodKind, Outcome, Report, RunSummary, json_clean, load_report, migrate_columns,
                         migrate_report)
from ..errors import LogitdiffError
from ..defaults import FLIP_AGREEMENT_TEXT
from .gates import get_path as _get
from .names import distinct_names
from .metric_registry import METRICS
from ..contracts import HTML_DATA_SCHEMA, HTML_GENERATOR_META
from ..store.files import Kind, same_directory, writing
from ..numerics.stats import adjacent_pairs, per_item_values
from ..numerics.summarize import DEFAULT_BOOTSTRAP

# Buckets of the reference's probability of its own top token.
REF_CONF_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
# Token shading: KL in nats on a log scale from SHADE_LO (no shade) to SHADE_HI (full).
SHADE_LO, SHADE_HI = 1e-4, 1.0
WORST_ITEMS = 5
# tokens.parquet columns the page uses (others are not read).
TOKEN_COLUMNS = (
    "item_id", "position", "token_id", "token", "kl_nats", "top1_match", "top1_ref", "top1_cand",
    "p_ref_token", "p_cand_token", "margin_ref", "reference_top_token", "candidate_top_token",
    "p_top1_ref", "p_top1_cand", "top5_ref_ids", "top5_ref_p", "top5_cand_ids", "top5_cand_p", "top5_ref_tokens", "top5_cand_tokens",
)
# Columns holding a short list per position (the top-5 of each model).
LIST_COLUMNS = ("top5_ref_ids", "top5_ref_p", "top5_cand_ids", "top5_cand_p", "top5_ref_tokens", "top5_cand_tokens")
# Identity fields worth showing as "machine / versions" (whatever of these a source records).
VERSION_KEYS = (
    "backend", "torch", "transformers", "llama_cpp_python", "server", "device",
    "dtype", "threads", "attn_implementation", "architecture", "arch",
)

# The tables' columns, generated from the metric registry (logitdiff.report.metric_registry): header,
# tooltip (meaning; unit, direction; aggregate), report.json paths and format declared there once.
def _col(name: str, paths: bool = True) -> tuple:
    m = METRICS[name]
    return (m.key, m.header, m.describe(), m.paths if paths else m.paths[0], m.fmt)


# The candidate matrix: (key, header, tooltip, report.json paths tried in order, format).
MATRIX = (
    ("file_size", "file size", "candidate weight file size (GGUF sources record it)", ("candidate.identity.size",), "bytes"),
    *(_col(n) for n in ("kl_mean", "kl_p95", "kl_p99", "kl_rev_mean", "kl_rev_p95", "kl_rev_p99", "jsd_mean",
                        "top1_disagreement", "x_noise_floor", "ppl_ratio")),
)
CI_OF = {
    "kl_mean": "summary.metrics.kl_nats.ci95",
    "kl_rev_mean": "summary.metrics.kl_rev_nats.ci95",
    "jsd_mean": "summary.metrics.jsd_nats.ci95",
    "top1": "summary.top1_disagreement.ci95",
}
# The labelled-items part of the consequences table: (key = correctness.KEY, header, tooltip, format).
CORRECTNESS = tuple((k, h, t, f) for k, h, t, _, f in (_col(n) for n in (
    "accuracy_ref", "accuracy_cand", "right_to_wrong", "wrong_to_right", "mcnemar_p", "tool_call_valid_cand")))
# The consequences table (what the drift does), flips part: (key, header, tooltip, report.json path, format).
FLIP_COLUMNS = tuple(_col(n, paths=False) for n in ("flips", "flip_branches", *Outcome.ALL, "flip_ties"))
_OUTCOME_KEYS = {METRICS[o].key: o for o in Outcome.ALL}  # a flip column's key -> the outcome it counts
# Fields other parts of logitdiff add to report.json from schema 1.2 on, shown when a report
# has them: (key, header, tooltip, report.json paths tried in order, format).
OPTIONAL_COLUMNS = tuple(_col(n) for n in ("flips_left_out", "flips_ref_not_top1", "cut_cand"))
X_CROSS_ENGINE_FLOOR = _col("x_cross_engine_floor")

# One colour per flip outcome on every page and in every part of it (the by-tag bars, the
# outcome labels of the branches table): keyed by the outcome, never by the order in which a
# page's outcomes happen to occur (plotly's colourway would give the same outcome another
# colour on a page where another set of outcomes occurred).
OUTCOME_COLORS = {
    Outcome.RECOVERED: "#2ca02c",
    Outcome.ANSWER_SAME: "#98df8a",
    Outcome.TESTS_PASSED: "#17becf",
    Outcome.DIVERGED: "#bcbd22",
    Outcome.ANSWER_CHANGED: "#8c564b",
    Outcome.TESTS_FAILED: "#e377c2",
    Outcome.TOOL_CALL_CHANGED: "#ff7f0e",
    Outcome.TOOL_CALL_MALFORMED: "#9467bd",
    Outcome.BENIGN: "#8fa9c8",
    Outcome.MEANING_CHANGED: "#d62728",
}
OTHER_OUTCOME_COLOR = "#7f7f7f"  # an outcome a newer flips stage writes that this map does not know


def outcome_css(outcomes: Sequence[str]) -> str:
    """The outcome labels' colours, for the outcomes a page shows (a page names no class it
    does not have: without a judge, never benign or meaning_changed)."""
    return "".join(f".outcome.{o}{{border-left:4px solid {OUTCOME_COLORS[o]};padding-left:4px}}"
                   for o in outcomes if o in OUTCOME_COLORS)


CSS = """table.flips td.cont{white-space:pre-wrap;max-width:28em;font-size:12px;text-align:left} table.flips td{vertical-align:top} 
.cont .ftok{outline:2px solid #1f4fd1;outline-offset:-1px;background:#e3ebff}.cont .joined{background:#dff3e1}
.cont .left{background:#fde4e2}.cont .cut{display:inline-block;width:0;border-left:2px solid #c62828;height:1.1em;vertical-align:text-bottom}
:root{--fg:#1d2330;--mut:#5b6475;--line:#d9dde5;--bg:#fff;--alt:#f5f7fa;--warn:#fff4d6;--warnb:#e0a800}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);margin:0 auto;max-width:1500px;padding:16px 24px}
h1{font-size:22px;margin:4px 0 8px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:15px;margin:16px 0 6px}
.lead{color:var(--mut);margin:0 0 12px}
dl.hdr{display:grid;grid-template-columns:max-content 1fr;gap:3px 16px;margin:0}dl.hdr dt{color:var(--mut)}dl.hdr dd{margin:0}
code,.mono{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:13px}
th,td{padding:3px 6px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top;white-space:nowrap}
th{background:var(--alt);position:sticky;top:0;font-weight:600}
table.matrix th{white-space:normal;max-width:7.5em;vertical-align:bottom}table.matrix th,table.matrix td{padding:3px 5px}
table.matrix .cand{position:sticky;left:0;z-index:1;background:var(--bg);max-width:13em;white-space:normal}
table.matrix th.cand{z-index:2;background:var(--alt)}table.matrix tr.warn td.cand{background:var(--warn)}
table.matrix .cand code{white-space:normal;overflow-wrap:anywhere}table.matrix .badge{display:block;width:max-content;max-width:100%;white-space:normal;margin:2px 0 0}
ul.verdicts{list-style:none;padding:0;margin:0}ul.verdicts li{margin:0 0 6px;padding:4px 8px;border-left:3px solid var(--line)}
ul.verdicts code{font-weight:600;margin-right:4px}.v-bad{color:#b71c1c;font-weight:600}.v-warn{color:#8a5a00}.v-ok{color:#2e7d32}
.unevaluated{color:#8a5a00;font-weight:600}
th:first-child,td:first-child{text-align:left}
table.sortable th[data-sort]{cursor:pointer;user-select:none}
table.sortable th[data-sort]:hover{background:#e8ecf3}
th[data-dir=asc]::after{content:" ▲"}th[data-dir=desc]::after{content:" ▼"}
td small{display:block;color:var(--mut);font-size:11px}td small.interval{white-space:normal;min-width:9em}
tr.warn td{background:var(--warn)}
.badge{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;background:var(--warn);border:1px solid var(--warnb);margin-left:6px}
.badge.bad{background:#fde4e2;border-color:#c62828;color:#b71c1c}
.crossed{color:#c62828;font-weight:600}.passed{color:#2e7d32}
.scroll{overflow-x:auto}
.note{color:var(--mut);font-size:13px;margin:4px 0}
.plot{width:100%;height:420px}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:12px}@media(max-width:1000px){.grid2{grid-template-columns:1fr}}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
.toks{white-space:pre-wrap;word-break:break-word;border:1px solid var(--line);border-radius:4px;padding:8px;background:#fcfcfd}
.toks span{background:rgba(214,39,40,var(--a,0));border-radius:2px}
.toks span.flip{outline:2px solid #1f4fd1;outline-offset:-1px}
.legend{display:inline-block;width:160px;height:10px;vertical-align:middle;background:linear-gradient(90deg,rgba(214,39,40,0),rgba(214,39,40,.85));border:1px solid var(--line)}
td.say{text-align:left;white-space:normal;min-width:220px}
footer{margin-top:32px;color:var(--mut);font-size:12px}
"""

# Sorting, plot rendering and the #selftest hook (used by the headless-browser test).
JS = r"""
(function(){
  var errors = [];
  window.addEventListener('error', function(e){ errors.push(String(e.message || e)); });
  function val(row, i, text){
    var c = row.cells[i], v = c ? c.getAttribute('data-v') : null;
    if (v === null || v === '') return null;
    return text ? v : parseFloat(v);
  }
  function sortBy(th){
    var table = th.closest('table'), body = table.tBodies[0];
    var i = Array.prototype.indexOf.call(th.parentNode.children, th);
    var dir = th.getAttribute('data-dir') === 'asc' ? 'desc' : 'asc', text = th.getAttribute('data-sort') === 'text';
    table.querySelectorAll('th').forEach(function(h){ h.removeAttribute('data-dir'); });
    th.setAttribute('data-dir', dir);
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function(a, b){
      var x = val(a, i, text), y = val(b, i, text);
      if (x === null || y === null) return (x === null) - (y === null);  // n/a always last
      var c = x < y ? -1 : x > y ? 1 : 0;
      return dir === 'asc' ? c : -c;
    });
    rows.forEach(function(r){ body.appendChild(r); });
  }
  document.querySelectorAll('table.sortable th[data-sort]').forEach(function(th){
    th.addEventListener('click', function(){ sortBy(th); });
  });
  var figs = JSON.parse(document.getElementById('logitdiff-figures').textContent);
  if (typeof Plotly === 'undefined' && figs.length) {  // a RUN's shared plotly.min.js not found beside the page
    var missing = document.getElementById('plotly-missing');
    if (missing) missing.hidden = false;
    errors.push('plotly.js not loaded');
    figs = [];
  }
  var config = {displaylogo: false, responsive: true, showLink: false, showSendToCloud: false, showEditInChartStudio: false};
  figs.forEach(function(f){
    try { Plotly.newPlot(f.id, f.data, f.layout, config); } catch (e) { errors.push(f.id + ': ' + e); }
  });
  if (location.hash === '#selftest') {
    var pm = document.getElementById('plotly-missing');
    var res = {errors: errors, plots: {}, sort: null, plotly_missing: pm ? !pm.hidden && pm.getBoundingClientRect().height > 0 : null};
    document.querySelectorAll('.plot').forEach(function(d){ res.plots[d.id] = d.querySelectorAll('.main-svg').length; });
    var th = document.querySelector('#matrix th[data-key=kl_mean]');
    if (th) {
      var col = Array.prototype.indexOf.call(th.parentNode.children, th);
      var read = function(){ return Array.prototype.map.call(document.querySelectorAll('#matrix tbody tr'), function(r){ return val(r, col, false); }); };
      th.click(); var up = read(); th.click(); var down = read();
      var mono = function(a, s){ for (var k = 1; k < a.length; k++) if (a[k] !== null && a[k-1] !== null && s * (a[k] - a[k-1]) < 0) return false; return true; };
      res.sort = {asc: up, desc: down, ok: mono(up, 1) && mono(down, -1) && up.length > 0};
    }
    // Layout at this window size: does each candidate table fit without scrolling?
    res.layout = {width: window.innerWidth, doc: document.documentElement.scrollWidth, tables: {}};
    ['matrix', 'consequences'].forEach(function(id){
      var t = document.getElementById(id);
      if (!t) return;
      var w = t.parentNode, b = t.getBoundingClientRect();
      res.layout.tables[id] = {left: b.left, right: b.right, width: b.width, scroll: w.scrollWidth, client: w.clientWidth};
    });
    // Each candidate cell: the name it shows, and whether its text stays inside the cell
    // (a long name must wrap or fold, never run under the next column).
    res.layout.cands = {};
    ['matrix', 'consequences'].forEach(function(id){
      var rows = document.querySelectorAll('#' + id + ' tbody tr');
      res.layout.cands[id] = Array.prototype.map.call(rows, function(r){
        var td = r.children[0], code = td.querySelector('code'), next = r.children[1];
        var c = td.getBoundingClientRect(), k = code.getBoundingClientRect();
        return {shown: code.textContent, title: td.title, inside: k.right <= c.right + 0.5 && k.left >= c.left - 0.5,
                next_left: next ? next.getBoundingClientRect().left : null, right: c.right};
      });
    });
    var v = document.querySelector('ul.verdicts');
    res.layout.verdicts = v ? {top: v.getBoundingClientRect().top, n: v.children.length} : null;
    var out = document.createElement('pre'); out.id = 'selftest-result'; out.textContent = JSON.stringify(res);
    document.body.appendChild(out);
  }
})();
"""


# ----------------------------------------------------------------------------- helpers


def _first(report: dict, paths: Sequence[str]) -> tuple[Any, str | None]:
    for p in paths:
        v = _get(report, p)
        if v is not None:
            return v, p
    return None, None


def _num(x) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt(x, kind: str = "g") -> str:
    """Display formatting only (never a new number): 4 significant digits, % for rates."""
    v = _num(x)
    if v is None:
        # Not a number: say so, or show the (escaped) text the report holds.
        return "n/a" if x is None or isinstance(x, (bool, int, float)) else html.escape(str(x))
    if kind == "pct":
        return f"{100 * v:.2f} %"
    if kind == "pct1":
        return f"{100 * v:.1f} %"
    if kind == "x":
        # 3 significant digits, without an exponent up to 1e9 (14,600×, not 1.46e+04×)
        return f"{float(f'{v:.3g}'):,.0f}×" if 1e3 <= abs(v) < 1e9 else f"{v:.3g}×"
    if kind == "ratio":
        return f"{v:.5f}"
    if kind == "bytes":
        for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= div:
                return f"{v / div:.3g} {unit}"
        return f"{v:.0f} B"
    if v == 0:
        return "0"
    if isinstance(x, int) or (v.is_integer() and abs(v) < 1e9 and kind == "int"):
        return str(int(v))
    return f"{v:.4g}"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def readable_token(tok: str) -> str:
    """Byte-level BPE pieces shown as text: 'Ġ' is a space, 'Ċ' a newline, 'ĉ' a tab."""
    return str(tok).replace("Ġ", " ").replace("Ċ", "\n").replace("ĉ", "\t")


def _json_for_script(obj) -> str:
    """JSON safe inside <script>: no '</script>' or '<!--' can be formed."""
    text = json.dumps(obj, allow_nan=False, separators=(",", ":"), default=_json_default)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def token_columns(tok) -> dict[str, np.ndarray] | None:
    """tokens.parquet content as numpy columns, from a DataFrame, a mapping or report rows."""
    if tok is None:
        return None
    if hasattr(tok, "columns") and hasattr(tok, "__getitem__") and not isinstance(tok, Mapping):
        cols = {str(c): tok[c] for c in tok.columns}
        return {k: np.asarray(v.to_numpy()) for k, v in migrate_columns(cols).items() if k in TOKEN_COLUMNS}
    return {k: np.asarray(v) for k, v in migrate_columns(dict(tok)).items() if k in TOKEN_COLUMNS}


def _rows_as_columns(report: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    rows = report.get("rows") or []
    if not rows:
        return None
    cols = {k: (_object_array([r.get(k) for r in rows]) if k in LIST_COLUMNS else np.asarray([r.get(k) for r in rows]))
            for k in TOKEN_COLUMNS if k in rows[0]}
    if "item_id" not in cols and "source_id" in rows[0]:
        cols["item_id"] = np.asarray([r["source_id"] for r in rows])
    return cols


def _object_array(values: list) -> np.ndarray:
    """One entry per position, each a list (a 1-D object array, whatever the lists' lengths)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def load_tokens(path: str | Path) -> dict[str, np.ndarray] | None:
    """The columns of tokens.parquet the page needs (pyarrow only; pandas not required)."""
    path = Path(path)
    if not path.exists():
        return None
    from .arrow_columns import read_parquet, to_numpy

    # a schema-1.x report's columns under their 2.0 names (contracts.migrate_columns)
    def stored(file_names: list[str]) -> list[str]:
        in_file = migrate_columns({name: name for name in file_names})  # 2.0 name -> the name in the file
        return [in_file[c] for c in TOKEN_COLUMNS if c in in_file]

    table = read_parquet(path, stored)
    return migrate_columns({name: to_numpy(table.column(name)) for name in table.column_names})


# ----------------------------------------------------------------------------- checks
def _method_key(report: Mapping[str, Any]) -> tuple:
    m = report.get("method") or {}
    kind = m.get("kind")
    # For full-vocabulary reports top_logprobs is only the K of the auxiliary top-K fields.
    return (kind, m.get("top_logprobs") if kind == MethodKind.TOP_K else None)


def _teacher(cols: dict | None):
    if not cols or not all(k in cols for k in ("item_id", "position", "token_id")):
        return None
    ids = np.asarray(cols["item_id"]).astype(str)
    pos = np.asarray(cols["position"], dtype=np.int64)
    order = np.lexsort((pos, ids))
    return ids[order], pos[order], np.asarray(cols["token_id"], dtype=np.int64)[order]


def check_reports_on_one_page(reports: Sequence[Mapping[str, Any]], tokens: Sequence[dict | None], labels: Sequence[str]) -> None:
    """Refuse reports that do not measure the same thing (see the module docstring)."""
    if not reports:
        raise LogitdiffError("logitdiff report: no reports given")
    first = reports[0]
    t0 = _teacher(tokens[0]) if tokens else None
    for i in range(1, len(reports)):
        r = reports[i]
        a, b = labels[0], labels[i]

        def refuse(field, va, vb, hint=""):
            raise LogitdiffError(f"cannot put {a} and {b} on one page: different {field} ({va!r} vs {vb!r}){hint}")

        if r.get("schema") != first.get("schema"):
            refuse("schema", first.get("schema"), r.get("schema"))
        ha, hb = _get(first, "reference.tokenizer_hash"), _get(r, "reference.tokenizer_hash")
        if ha and hb and ha != hb:
            refuse("workload: reference.tokenizer_hash", ha[:19] + "…", hb[:19] + "…")
        ia = sorted(str(x.get("id")) for x in first.get("items") or [])
        ib = sorted(str(x.get("id")) for x in r.get("items") or [])
        if ia != ib:
            only = sorted(set(ia) ^ set(ib))[:3]
            refuse("workload: item ids", f"{len(ia)} items", f"{len(ib)} items", f"; e.g. {', '.join(only)} in only one")
        if _method_key(first) != _method_key(r):
            refuse("method (kind, top-K K)", _method_key(first), _method_key(r), "; make one page per method")
        ti = _teacher(tokens[i]) if tokens else None
        if t0 is not None and ti is not None:
            if len(t0[0]) != len(ti[0]) or not (np.array_equal(t0[0], ti[0]) and np.array_equal(t0[1], ti[1])):
                refuse("workload: teacher positions (tokens.parquet item_id/position)", f"{len(t0[0])} positions", f"{len(ti[0])} positions")
            if not np.array_equal(t0[2], ti[2]):
                k = int(np.flatnonzero(t0[2] != ti[2])[0])
                refuse("workload: teacher tokens (tokens.parquet token_id)", f"{t0[0][k]}@{t0[1][k]}={t0[2][k]}", f"{ti[2][k]}")


# ----------------------------------------------------------------------------- derived data
def kl_cdf(kl: np.ndarray, max_points: int = 1500) -> dict:
    """Empirical CDF of KL: x = sorted positive KL, y = share of positions ≤ x.

    Zeros cannot sit on a log axis, so the curve starts at the share of KL == 0 (recorded
    as ``n_zero``). Long columns are thinned to ``max_points`` points, denser in the tail
    where the interesting part of a KL distribution lives."""
    v = np.sort(np.asarray(kl, dtype=np.float64)[np.isfinite(kl)])
    n = int(v.size)
    if n == 0:
        return {"n": 0, "n_zero": 0, "x": [], "y": []}
    idx = np.arange(n)
    if n > max_points:
        body = np.linspace(0, 0.95, max_points // 2)
        tail = 1.0 - np.geomspace(0.05, 0.5 / n, max_points - max_points // 2)
        idx = np.unique(np.clip(np.ceil(np.concatenate([body, tail]) * n).astype(np.int64) - 1, 0, n - 1))
        idx = np.unique(np.concatenate([idx, [n - 1]]))
    keep = v[idx] > 0
    return {"n": n, "n_zero": int((v <= 0).sum()), "x": v[idx][keep].tolist(), "y": ((idx[keep] + 1) / n).tolist()}


def ref_confidence(cols: dict) -> tuple[np.ndarray, str, int]:
    """Per position: the reference's probability of its own top token, and how it was had.

    Where tokens.parquet has ``p_top1_ref`` (the reference's probability of its own top-1
    token, recorded at every position) that column is used as is: exactly the quantity
    exllamav3 buckets by. Older files have no top-1 probability column, but where the teacher token is the
    reference's top-1 (always, up to numerical ties, when the teacher is the reference's
    greedy output) ``p_ref_token`` *is* that probability; the other positions are left out
    (NaN) and counted. If fewer than half qualify (an imported, non-greedy teacher), the
    reference margin p1 − p2 (``margin_ref``) is bucketed instead, and labelled so."""
    n = len(cols["kl_nats"])
    if "p_top1_ref" in cols:
        p = np.asarray(cols["p_top1_ref"], dtype=np.float64)
        return (p, "p_top1_ref, the reference's probability of its own top-1 token at every position "
                "(exactly the reference's top-token probability, as exllamav3 buckets)", int((~np.isfinite(p)).sum()))
    if all(k in cols for k in ("p_ref_token", "token_id", "top1_ref")):
        p = np.asarray(cols["p_ref_token"], dtype=np.float64)
        ok = (np.asarray(cols["token_id"]) == np.asarray(cols["top1_ref"])) & np.isfinite(p)
        if n and ok.mean() >= 0.5:
            return np.where(ok, p, np.nan), "p_ref_token where the teacher token is the reference's top-1", int(n - ok.sum())
    if "margin_ref" in cols:
        m = np.asarray(cols["margin_ref"], dtype=np.float64)
        return m, "margin_ref (reference p1 − p2; no top-1 probability available)", int((~np.isfinite(m)).sum())
    return np.full(n, np.nan), "none", n


def bucket_stats(conf: np.ndarray, cols: dict, edges: Sequence[float] = REF_CONF_EDGES) -> dict:
    """Mean KL and top-1 disagreement per reference-confidence bucket ([a,b), last closed)."""
    kl = np.asarray(cols["kl_nats"], dtype=np.float64)
    mism = ~np.asarray(cols["top1_match"], dtype=bool)
    out: dict[str, list] = {"labels": [], "n": [], "kl_mean": [], "top1_disagreement": []}
    for j, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        last = j == len(edges) - 2
        m = (conf >= a) & ((conf <= b) if last else (conf < b))
        out["labels"].append(f"[{a:g},{b:g}]" if last else f"[{a:g},{b:g})")
        out["n"].append(int(m.sum()))
        out["kl_mean"].append(float(kl[m].mean()) if m.any() else None)
        out["top1_disagreement"].append(float(mism[m].mean()) if m.any() else None)
    return out


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Names on the size/KL Pareto frontier: nothing smaller has lower (or equal) KL."""
    front, best = [], math.inf
    for name, size, kl in sorted(points, key=lambda p: (p[1], p[2])):
        if kl < best:
            front.append(name)
            best = kl
    return front


def _item_value(by_id: dict, item_id: str, path: str) -> float:
    v = _num(_get(by_id.get(item_id) or {}, path))
    return np.nan if v is None else v


def _item_arrays(reports, tokens, names, item_ids):
    """Per candidate, item mean KL and item top-1 disagreement aligned with ``item_ids``:
    from report["items"] (the same numbers report.json shows), else from tokens.parquet."""
    kl, t1 = {}, {}
    for name, rep, cols in zip(names, reports, tokens):
        by_id = {str(x.get("id")): x for x in rep.get("items") or []}
        if by_id:
            kl[name] = np.array([_item_value(by_id, i, "kl_nats.mean") for i in item_ids], dtype=np.float64)
            t1[name] = np.array([_item_value(by_id, i, "top1_disagreement.rate") for i in item_ids], dtype=np.float64)
        elif cols is not None:
            kl[name] = per_item_values(cols["item_id"], cols["kl_nats"], item_ids)
            t1[name] = per_item_values(cols["item_id"], ~np.asarray(cols["top1_match"], dtype=bool), item_ids)
    return kl, t1


# ----------------------------------------------------------------------------- figures
def warm_up() -> None:
    """Pay the page's one-time costs now: plotly's figure classes imported, its property
    validators and the ``plotly_white`` template loaded (~0.5 s on first use). A live
    comparison calls it on a thread while the model runs (api.diff_runs), so the report is
    written without them once the last row is in. The page itself does not depend on it."""
    import plotly.graph_objects as go

    from .markdown import render_markdown  # noqa: F401 - imported for its first use
    from . import arrow_columns  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    _fig(_layout(go.Figure(go.Scatter(x=[1.0], y=[1.0], error_y={"type": "data", "array": [0.0]})), "warm-up"))


def _fig(fig) -> dict:
    """A plotly figure as plain JSON (data + layout) for Plotly.newPlot in the page."""
    d = json.loads(fig.to_json())
    return {"data": d.get("data", []), "layout": d.get("layout", {})}


def _layout(fig, title: str, top: int = 50, **kw):
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}}, template="plotly_white", margin={"l": 60, "r": 20, "t": top, "b": 50},
        legend={"font": {"size": 11}}, hovermode="closest", font={"family": "system-ui, sans-serif", "size": 12}, **kw,
    )
    return fig


def build_figures(names, reports, cdfs, buckets, conf_label, pareto) -> tuple[list[dict], list[str]]:
    """The page's plots, each {id, title, note, data, layout}; and notes on omitted plots.
    Each plot in turn: KL CDF, KL and top-1 disagreement by output range, drift by reference
    confidence, flip outcomes by tag, the size/KL Pareto frontier."""
    figs: list[dict] = []
    omitted: list[str] = []
    colors = _palette(len(names))
    for made, missing in (_kl_cdf_figures(names, colors, cdfs), _range_figures(names, colors, reports),
                          _confidence_figures(names, colors, buckets, conf_label), _flips_by_tag_figures(names, reports),
                          _pareto_figures(pareto)):
        figs += made
        omitted += [missing] if missing else []
    return figs, omitted


def _kl_cdf_figures(names, colors, cdfs) -> tuple[list[dict], str | None]:
    """The KL CDF of every candidate with tokens (or why there is none)."""
    import plotly.graph_objects as go

    if not any(c and c["x"] for c in cdfs.values()):
        return [], "KL CDF: no tokens.parquet"
    f = go.Figure()
    for name, col in zip(names, colors):
        c = cdfs.get(name)
        if c and c["x"]:
            f.add_scatter(x=c["x"], y=c["y"], name=name, mode="lines", line={"color": col, "width": 2},
                          hovertemplate=name + "<br>KL %{x:.3g} nats<br>share ≤ x: %{y:.4f}<extra></extra>")
    _layout(f, "KL(P_ref‖P_cand) per position: cumulative share (log x)")
    f.update_xaxes(type="log", title="KL, nats")
    f.update_yaxes(title="share of positions ≤ x", range=[0, 1.01])
    return [{"id": "plot-kl-cdf", "note": "Curves to the left are closer to the reference. Positions with KL exactly 0 "
             "cannot sit on a log axis: a curve starts at their share.", **_fig(f)}], None


def _range_figures(names, colors, reports) -> tuple[list[dict], str | None]:
    """Mean and p95 KL, and top-1 disagreement, by output range (report.json ``ranges``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ranges = [r.get("ranges") or [] for r in reports]
    if not any(ranges):
        return [], "output ranges: no ranges in report.json"
    figs = []
    f = make_subplots(rows=1, cols=2, subplot_titles=("mean KL (95 % CI)", "p95 KL"), horizontal_spacing=0.08)
    for name, col, rr in zip(names, colors, ranges):
        rr = [g for g in rr if g.get("n")]
        x = [g["group"] for g in rr]
        mean = [_get(g, "kl_nats.mean") for g in rr]
        ci = [_get(g, "kl_nats.ci95") or [None, None] for g in rr]
        f.add_scatter(x=x, y=mean, name=name, legendgroup=name, mode="lines+markers", line={"color": col}, row=1, col=1,
                      error_y={"type": "data", "symmetric": False, "array": [(c[1] - m) if None not in (c[1], m) else None for c, m in zip(ci, mean)],
                               "arrayminus": [(m - c[0]) if None not in (c[0], m) else None for c, m in zip(ci, mean)], "thickness": 1},
                      hovertemplate=name + " %{x}<br>mean KL %{y:.4g}<extra></extra>")
        f.add_scatter(x=x, y=[_get(g, "kl_nats.p95") for g in rr], name=name, legendgroup=name, showlegend=False, mode="lines+markers",
                      line={"color": col, "dash": "dot"}, row=1, col=2, hovertemplate=name + " %{x}<br>p95 KL %{y:.4g}<extra></extra>")
    _layout(f, "KL by output range (position from the start of the output)", top=80)
    f.update_yaxes(type="log", title="KL, nats")
    f.update_xaxes(type="category")
    figs.append({"id": "plot-ranges-kl", "note": "From report.json ranges. Empty ranges are left out.", **_fig(f)})

    f = go.Figure()
    for name, col, rr in zip(names, colors, ranges):
        rr = [g for g in rr if g.get("n")]
        rate = [_get(g, "top1_disagreement.rate") for g in rr]
        ci = [_get(g, "top1_disagreement.ci95") or [None, None] for g in rr]
        f.add_scatter(x=[g["group"] for g in rr], y=[None if v is None else 100 * v for v in rate], name=name, mode="lines+markers",
                      line={"color": col},
                      error_y={"type": "data", "symmetric": False, "thickness": 1,
                               "array": [100 * (c[1] - v) if None not in (c[1], v) else None for c, v in zip(ci, rate)],
                               "arrayminus": [100 * (v - c[0]) if None not in (c[0], v) else None for c, v in zip(ci, rate)]},
                      hovertemplate=name + " %{x}<br>top-1 disagreement %{y:.2f} %<extra></extra>")
    _layout(f, "Top-1 disagreement by output range (95 % CI)")
    f.update_yaxes(title="% of positions", rangemode="tozero")
    f.update_xaxes(type="category")
    figs.append({"id": "plot-ranges-top1", "note": "From report.json ranges.", **_fig(f)})
    return figs, None


def _confidence_figures(names, colors, buckets, conf_label) -> tuple[list[dict], str | None]:
    """Mean KL and top-1 disagreement by the reference's confidence in its own top token."""
    from plotly.subplots import make_subplots

    if not buckets:
        return [], "reference confidence: no tokens.parquet"
    f = make_subplots(rows=1, cols=2, subplot_titles=("mean KL", "top-1 disagreement (%)"), horizontal_spacing=0.08)
    for name, col in zip(names, colors):
        b = buckets.get(name)
        if not b:
            continue
        f.add_scatter(x=b["labels"], y=b["kl_mean"], customdata=b["n"], name=name, legendgroup=name, mode="lines+markers", line={"color": col},
                      row=1, col=1, hovertemplate=name + " p_ref %{x}<br>mean KL %{y:.4g}<br>%{customdata} positions<extra></extra>")
        f.add_scatter(x=b["labels"], y=[None if v is None else 100 * v for v in b["top1_disagreement"]], customdata=b["n"], name=name,
                      legendgroup=name, showlegend=False, mode="lines+markers", line={"color": col}, row=1, col=2,
                      hovertemplate=name + " p_ref %{x}<br>%{y:.2f} %<br>%{customdata} positions<extra></extra>")
    _layout(f, "Drift by reference confidence (p of the reference's top token)", top=80)
    f.update_yaxes(type="log", row=1, col=1, title="KL, nats")
    f.update_yaxes(rangemode="tozero", row=1, col=2)
    f.update_xaxes(type="category", title="reference confidence")
    return [{"id": "plot-ref-confidence", "note": f"Confidence column: {conf_label}. Decisions the reference was unsure of "
             "flip first; drift on confident positions is the worrying kind.", **_fig(f)}], None


def _flips_by_tag_figures(names, reports) -> tuple[list[dict], str | None]:
    """Flip outcomes by tag, stacked (report.json ``flips.by_tag``)."""
    import plotly.graph_objects as go

    by_tag = {n: _get(r, "flips.by_tag") for n, r in zip(names, reports) if _get(r, "flips.by_tag")}
    if not by_tag:
        return [], "flip outcomes by tag: no report has flips.by_tag (run flips to get it)"
    rows = []  # (candidate, tag, outcome, count)
    for name, bt in by_tag.items():
        for tag, d in bt.items():
            for outcome, count in _outcome_counts(d).items():
                rows.append((name, str(tag), outcome, count))
    # Outcomes that occurred, in the order the report lists them (flips.py: mildest first).
    outcomes = list(dict.fromkeys(r[2] for r in rows if r[3]))
    f = go.Figure()
    for oc in outcomes:
        sel = [r for r in rows if r[2] == oc and r[3]]
        f.add_bar(x=[[r[0] for r in sel], [r[1] for r in sel]], y=[r[3] for r in sel], name=oc,
                  marker={"color": OUTCOME_COLORS.get(oc, OTHER_OUTCOME_COLOR)})
    _layout(f, "Flip outcomes by tag", barmode="stack")
    f.update_yaxes(title="flips")
    return [{"id": "plot-flips-by-tag", "note": "From report.json flips.by_tag.", **_fig(f)}], None


def _pareto_figures(pareto) -> tuple[list[dict], str | None]:
    """Mean KL against file size, the Pareto frontier in red (two candidates with a size at least)."""
    import plotly.graph_objects as go

    if len(pareto["points"]) < 2:
        return [], "Pareto of KL vs file size: fewer than two candidates record a file size"
    pts, front = pareto["points"], set(pareto["front"])
    f = go.Figure()
    f.add_scatter(x=[p["size"] for p in pts], y=[p["kl_mean"] for p in pts], text=[p["name"] for p in pts], mode="markers+text",
                  textposition="top center", marker={"size": 10, "color": ["#d62728" if p["name"] in front else "#7f7f7f" for p in pts]},
                  name="candidates", hovertemplate="%{text}<br>%{x:.4s}B<br>mean KL %{y:.4g}<extra></extra>")
    fp = sorted((p for p in pts if p["name"] in front), key=lambda p: p["size"])
    f.add_scatter(x=[p["size"] for p in fp], y=[p["kl_mean"] for p in fp], mode="lines", line={"color": "#d62728", "dash": "dot"},
                  name="Pareto frontier", hoverinfo="skip")
    _layout(f, "Mean KL vs file size (Pareto frontier in red)")
    f.update_xaxes(title="file size, bytes", type="log")
    f.update_yaxes(title="mean KL, nats", type="log")
    return [{"id": "plot-pareto", "note": "File size from candidate.identity; candidates without one are left out.", **_fig(f)}], None


def _outcome_counts(d) -> dict[str, int]:
    """Outcome -> count of ``flips.outcomes`` or of one ``flips.by_*`` group (which adds n and rates)."""
    if not d:
        return {}
    return {o: d[o] for o in Outcome.ALL if o in d}


def _palette(n: int) -> list[str]:
    base = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    return [base[i % len(base)] for i in range(n)]


# ----------------------------------------------------------------------------- HTML parts
def _header(names, paths, reports, summary) -> str:
    r0 = reports[0]
    b = r0.get("reference") or {}
    m = r0.get("method") or {}
    s0 = r0.get("summary") or {}
    if m.get("kind") == MethodKind.TOP_K:
        floors = {_get(r, "method.logprob_floor_nats") for r in reports}
        floor = next(iter(floors))
        stated = ("" if floors == {None} else ", stated log-probability floors differ per report (each interval names its own)"
                  if len(floors) > 1 else f", upper ends from the stated log-probability floor {_e(fmt(floor))} nats")
        method = (f"top-K approximation, K = {_e(m.get('top_logprobs'))} of V = {_e(m.get('vocab_size'))} (the seed report's method), "
                  f"with proven intervals ({_e(m.get('bounds'))}{stated}; docs/bounds.md)")
    elif m.get("kind") == MethodKind.COMPACT:
        method = (f"compact reference vs full candidate (V = {_e(m.get('vocab_size'))}): each divergence with a "
                  f"proven interval ({_e(m.get('bounds'))}; docs/bounds.md)")
    else:
        method = f"exact, full vocabulary (V = {_e(m.get('vocab_size'))}), float64 after log_softmax"
    boot = m.get("bootstrap") or {}
    floors = {json.dumps(_get(r, "summary.noise_floor"), sort_keys=True) for r in reports}
    nf = s0.get("noise_floor")
    if len(floors) > 1:
        noise = "differs per report (see × noise floor)"
    elif nf:  # .get: reports written before schema_version 1.0 carry other noise_floor shapes
        noise = (f"mean KL {fmt(nf.get('kl_nats_mean'))} nats, top-1 disagreement {fmt(nf.get('top1_disagreement'), 'pct')} "
                 f"(<code>{_e(nf.get('spec'))}</code> against its own {_e(nf.get('rerun') or 'rerun')}, "
                 f"{_e(nf.get('positions'))} positions)")
        if nf.get("kl_nats_mean") == 0:
            noise += " — the rerun is bit-identical, so × noise floor is undefined"
    else:
        noise = "not measured"
    rows = [
        ("reference", f"<code>{_e(b.get('spec') or b.get('path'))}</code> ({_e(b.get('store'))} logits, {_e(b.get('dtype'))})"),
        ("candidates", ", ".join(f"<code>{_e(n)}</code>" for n in names) + f" ({len(names)})"),
    ]
    if any(r.get("gates") for r in reports):
        rows.append(("gates", _gates_html(names, reports)))
    rows += [
        ("workload", f"{_e(s0.get('paired_prompts'))} items, {_e(s0.get('positions'))} teacher-forced output positions"
         + (f"; <code>{_e(summary.get('workload'))}</code>" if summary and summary.get("workload") else "")),
        ("method", method + ((f"; 95 % CIs from {_e(boot.get('n'))} bootstrap resamples of items" if boot.get("n")
                               else "; no 95 % CIs (--bootstrap 0)") if boot else "")),
        ("noise floor", noise),
    ]
    sfs = {json.dumps(_get(r, "summary.served_floor"), sort_keys=True) for r in reports} - {"null"}
    if sfs:  # served sides captured again with other batch mates (servedfloor.py)
        sf = s0.get("served_floor") if len(sfs) == 1 else None
        if sf:
            sides = "; ".join(f"{k} <code>{_e(v.get('spec'))}</code> ({_e(v.get('batching'))}, {_e(v.get('measured_by'))}): "
                              f"mean KL {fmt(v.get('kl_nats_mean'))} nats over {_e(v.get('positions'))} positions"
                              for k in ("reference", "candidate") if isinstance(v := sf.get(k), dict))
            rows.append(("served floor", f"mean KL {fmt(sf.get('kl_nats_mean'))} nats ({_e(sf.get('rule'))}); {sides}"))
        else:
            rows.append(("served floor", "differs per report (see each report's served floor)"))
    batch = {json.dumps(_get(r, "method.served_batching"), sort_keys=True) for r in reports} - {"null"}
    if batch:
        sb = _get(reports[0], "method.served_batching") if len(batch) == 1 else None
        rows.append(("served batching", "differs per report" if sb is None else
                     ", ".join(f"{_e(k)}: {_e(v)}" for k, v in sb.items() if v)))
    rows_from = {str(v) for r in reports if (v := _get(r, "reference.identity.reference_rows"))}
    if rows_from:  # a served reference: its rows from its generation, or rescored teacher-forced
        rows.append(("reference rows", "<br>".join(_e(v) for v in sorted(rows_from))))
    xf = (summary or {}).get("cross_engine_floor")
    if xf:
        rows.append(("cross-engine floor", f"<code>{_e(xf.get('candidate'))}</code>: the reference's weights in another engine, "
                     f"mean KL {fmt(xf.get('kl_nats_mean'))} nats (from summary.json)"))
    ident = b.get("identity") or {}
    ref_v = ", ".join(f"{k} {_e(ident[k])}" for k in VERSION_KEYS if ident.get(k) not in (None, ""))
    cand_v: dict[str, set] = {}
    for r in reports:
        ci = _get(r, "candidate.identity") or {}
        for k in VERSION_KEYS:
            if ci.get(k) not in (None, ""):
                cand_v.setdefault(k, set()).add(str(ci[k]))
    rows.append(("machine / versions", f"reference: {ref_v or 'n/a'}<br>candidates: "
                 + (", ".join(f"{k} {_e(' / '.join(sorted(v)))}" for k, v in cand_v.items()) or "n/a")))
    machines = sorted({_machine_text(r["machine"]) for r in reports if r.get("machine")})
    if machines:
        rows.append(("machine", "<br>".join(_e(m) for m in machines)))
    tools = sorted({str(_get(r, "tool.version")) for r in reports})
    created = sorted(str(r.get("created")) for r in reports if r.get("created"))
    rows.append(("tool", f"reports by logitdiff {_e(', '.join(tools))}; page by logitdiff {_e(__version__)}"))
    rows.append(("date", (f"reports {_e(created[0])}" + (f" … {_e(created[-1])}" if created[-1] != created[0] else "") if created else "n/a")
                 + f"; page {_e(time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))}"))
    notes = sorted({n for r in reports for n in (_get(r, "method.notes") or [])})
    for n in notes:
        rows.append(("note", _e(n)))
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<dl class="hdr">{dl}</dl>'


def _crossed_gates(report: Report) -> list[GateResult]:
    """The crossed gates of a report's ``gates`` section (gates.evaluate's shape; a missing
    metric is never crossed, also in reports written before schema 1.2)."""
    g = report.get("gates")
    return [x for x in g["gates"] if x["crossed"] and not x.get("missing")] if g else []


def _not_evaluated_gates(report: Report) -> list[GateResult]:
    """The gates whose metric the report lacks: not evaluated."""
    g = report.get("gates")
    return [x for x in g["gates"] if x.get("missing")] if g else []


def _verdicts_html(names, reports, cells, summary) -> str:
    """One line per candidate, first on the page: drift against a floor, what the flips did,
    whether the answers changed significantly (report.verdict words report.json's numbers)."""
    from .verdict import verdict

    xf = str(((summary or {}).get("cross_engine_floor") or {}).get("candidate"))
    items = []
    for name, rep in zip(names, reports):
        parts = verdict(rep, x_cross_engine_floor=(cells[name].get("x_cross_engine_floor") or {}).get("value"),
                        is_cross_engine_floor=summary is not None and str(_get(rep, "candidate.spec")) == xf)
        text = " · ".join(f'<span class="v-{sev}">{_e(t)}</span>' for sev, t in parts)
        items.append(f'<li data-name="{_e(name)}"><code>{_e(name)}</code> {text}{_attributed_items(name, rep)}</li>')
    return f'<ul class="verdicts">{"".join(items)}</ul>'


def flip_anchor(name: str, item_id: Any, position: Any) -> str:
    """The id of a branch's row in "What the flips do" (one per candidate, item and position)."""
    return "flip-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{item_id}-{position}")


def _attributed_items(name: str, rep: Mapping[str, Any]) -> str:
    """The verdict's changed answers (correctness.attribution), each with its first flip and
    branch, linked to the branch's row where the page shows it (flips.top)."""
    records = [r for r in _get(rep, "correctness.attribution") or [] if isinstance(r, Mapping)]
    if not records:
        return ""
    shown = {(str(t.get("item_id")), t.get("position")) for t in _get(rep, "flips.top") or [] if isinstance(t, Mapping)}
    each = []
    for r in records:
        f, b = r.get("first_flip"), r.get("branch")
        said = f"{r.get('direction', '').replace('_to_', '→')}"
        said += (f", flip at {f.get('position')} {_show(f.get('ref_token'))}→{_show(f.get('cand_token'))}" if f
                 else f", {r.get('no_flip') or 'no teacher-forced flip'}")
        said += f", branch {b.get('outcome')} at {b.get('position')}" if b else f", not branched: {r.get('not_branched')}"
        item = f"<code>{_e(r.get('item_id'))}</code>"
        if b and (str(r.get("item_id")), b.get("position")) in shown:
            item = f'<a href="#{flip_anchor(name, r.get("item_id"), b.get("position"))}">{item}</a>'
        each.append(f"{item} ({_e(said)})")
    return f'<br><span class="attributed">changed answers: {"; ".join(each)}</span>'


def _gates_html(names, reports) -> str:
    """Per candidate: the gates it crossed, in red, with the value that crossed; those not
    evaluated (metric not in the report), with the reason; or that all passed."""
    lines = []
    for name, rep in zip(names, reports):
        g = rep.get("gates")
        if not g:
            lines.append(f"<code>{_e(name)}</code>: no gates evaluated")
            continue
        total = len(g["gates"])
        crossed, missing = _crossed_gates(rep), _not_evaluated_gates(rep)
        if not crossed and not missing:
            lines.append(f'<code>{_e(name)}</code>: <span class="passed">✓ passed {"all " + str(total) + " gates" if total else "(no gates)"}</span>')
            continue
        said = []
        if crossed:
            each = ", ".join(f'<span class="crossed" title="{_e(x.get("metric", ""))} = {_e(repr(x.get("value")))}">'
                             f'{_e(x["gate"])} ({fmt(x.get("value"))})</span>' for x in crossed)
            said.append(f'<span class="crossed">✗ crossed {len(crossed)}{" of " + str(total) if total else ""}:</span> {each}')
        if missing:
            each = ", ".join(f'<span class="unevaluated" title="{_e(x.get("reason") or "")}">{_e(x["gate"])} '
                             f'({_e(x.get("reason") or "metric not in the report")})</span>' for x in missing)
            said.append(f'<span class="unevaluated">? not evaluated {len(missing)}{" of " + str(total) if total else ""}:</span> {each}')
        lines.append(f"<code>{_e(name)}</code>: " + "; ".join(said))
    return "<br>".join(lines) + ('<br><small class="note">A --fail-on clause is a failure condition, a --require clause must hold; '
                                 "a clause whose metric the report lacks is not evaluated (neither crossed nor passed).</small>")


def matrix_data(names, reports, summary) -> tuple[dict, list[str]]:
    """Per candidate, every cell of both tables as {value, from} (from: where in report.json,
    or summary.json); and the keys of the consequences table's columns, in order."""
    out = {}
    xrows = {str(c.get("candidate")): c for c in (summary or {}).get("candidates") or []}
    has_flips = any(_get(r, "flips.outcomes") is not None for r in reports)
    # of the outcome columns, those that occur on this page (ten would not fit 1,400 px)
    occurring = set(Outcome.occurring(*(_get(r, "flips.outcomes") for r in reports)))
    flip_columns = [c for c in FLIP_COLUMNS if c[0] not in _OUTCOME_KEYS or _OUTCOME_KEYS[c[0]] in occurring]
    has_corr = any(r.get("correctness") for r in reports)
    optional = [(k, paths) for k, _, _, paths, _ in OPTIONAL_COLUMNS if any(_first(r, paths)[1] for r in reports)]
    for name, rep in zip(names, reports):
        cells = {}
        for key, _, _, paths, _ in MATRIX:
            v, p = _first(rep, paths)
            cells[key] = {"value": v, "from": p or paths[0]}
            if key in CI_OF:
                cells[key + "_ci95"] = {"value": _get(rep, CI_OF[key]), "from": CI_OF[key]}
        sc = xrows.get(str(_get(rep, "candidate.spec")))
        if summary is not None:
            cells["x_cross_engine_floor"] = {"value": (sc or {}).get("x_cross_engine_floor"), "from": "summary.json:candidates[].x_cross_engine_floor"}
        if has_flips:
            for key, _, _, path, _ in flip_columns:
                cells[key] = {"value": _get(rep, path), "from": path}
        if has_corr:
            for key, *_ in CORRECTNESS:
                cells[key] = {"value": _get(rep, f"correctness.{key}"), "from": f"correctness.{key}"}
        for key, paths in optional:
            v, p = _first(rep, paths)
            cells[key] = {"value": v, "from": p or paths[0]}
        out[name] = cells
    conseq = ([k for k, *_ in flip_columns] if has_flips else []) + ([k for k, *_ in CORRECTNESS] if has_corr else [])
    # the optional flips columns after the flips ones, the truncated column after correctness
    for key, _ in optional:
        at = len(conseq) if key == "cut_cand" or not has_flips else len(flip_columns)
        conseq.insert(at, key)
    return out, conseq


def _candidate_cell(i, name, path, rep, xf, *, badges: bool = True, shown: str | None = None) -> tuple[str, bool]:
    """The frozen first cell: the candidate's name, and under it the badges (floors, gates)."""
    kl = _num(_get(rep, "summary.metrics.kl_nats.mean"))
    floor = _num(_get(rep, "summary.noise_floor.kl_nats_mean"))
    warn = []
    if kl is not None and floor is not None and kl <= 2 * floor:
        warn.append(("within 2× noise floor", "mean KL is at most twice the reference-vs-rerun KL: indistinguishable from noise"))
    if _get(rep, "summary.within_2x_served_floor"):
        warn.append(("within 2× served floor", "mean KL is at most twice what the servers' own batching moves rows by"))
    if _get(rep, "summary.kl_upper_uninformative"):
        warn.append(("KL upper bound uninformative", "the proven interval is wider than the estimate: read the mean KL from below"))
    xfl = _num(xf.get("kl_nats_mean"))
    if kl is not None and xfl and kl <= 2 * xfl and str(_get(rep, "candidate.spec")) != str(xf.get("candidate")):
        warn.append(("within 2× cross-engine floor", "mean KL is at most twice that of the same weights in another engine"))
    marks = "".join(f'<span class="badge" title="{_e(t)}">⚠ {_e(w)}</span>' for w, t in warn)
    crossed = _crossed_gates(rep)
    if crossed:
        marks += (f'<span class="badge bad" title="{_e("crossed: " + ", ".join(g["gate"] for g in crossed))}">'
                   f'✗ {len(crossed)} gate{"s" if len(crossed) != 1 else ""}</span>')
    missing = _not_evaluated_gates(rep)
    if missing:
        marks += (f'<span class="badge" title="{_e("not evaluated (metric not in the report): " + ", ".join(g["gate"] for g in missing))}">'
                   f'? {len(missing)} gate{"s" if len(missing) != 1 else ""} not evaluated</span>')
    full = f"{name} — {path}" if path and str(path) != name else name
    return (f'<td data-v="{i}" class="cand" title="{_e(full)}"><code>{_e(shown or name)}</code>{marks if badges else ""}</td>',
            bool(warn))


def _table_html(table_id, cols, names, paths, reports, cells_by_name, summary, *, badges: bool = True) -> str:
    """One sortable table of ``cols`` [(key, header, tooltip, format)], a row per candidate,
    the candidate column frozen (sticky) so it stays in view if the table must scroll."""
    head = ('<th data-sort="num" data-key="order" class="cand" title="candidate (click: original order)">candidate</th>'
            + "".join(f'<th data-sort="num" data-key="{k}" title="{_e(t)}">{_e(h)}</th>' for k, h, t, f in cols))
    xf = (summary or {}).get("cross_engine_floor") or {}
    body = []
    # the part of each name that tells it apart (a shared start folded to …); the full name and path on hover
    shown = distinct_names(names)
    for i, (name, path, rep) in enumerate(zip(names, paths, reports)):
        cells = cells_by_name[name]
        first, warn = _candidate_cell(i, name, path, rep, xf, badges=badges, shown=shown[i])
        tds = [first]
        for k, h, t, f in cols:
            v = cells.get(k, {}).get("value")
            nv = _num(v)
            ci = cells.get(k + "_ci95", {}).get("value")
            sub = ""
            if ci and None not in ci:
                sub = f"<small>[{fmt(ci[0], f)}, {fmt(ci[1], f)}]</small>"
            sub += _interval_sub(rep, k)
            tds.append(f'<td data-v="{"" if nv is None else repr(nv)}">{fmt(v, f)}{sub}</td>')
        body.append(f'<tr class="{"warn" if warn else ""}" data-name="{_e(name)}">' + "".join(tds) + "</tr>")
    return (f'<div class="scroll"><table id="{table_id}" class="sortable matrix"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _matrix_html(names, paths, reports, cells_by_name, conseq, summary) -> str:
    """Two tables that fit a 1,400 px window: how far each candidate drifts (#matrix), and
    what the drift does (#consequences: flips, answers, tool calls), when any report has it."""
    cols = [(k, h, t, f) for k, h, t, _, f in MATRIX]
    if summary is not None:
        # the cross-engine floor sits beside the noise floor
        at = [c[0] for c in cols].index("x_noise_floor") + 1
        k, h, t, _, f = X_CROSS_ENGINE_FLOOR
        cols.insert(at, (k, h, t + " (summary.json)", f))
    drift = _table_html("matrix", cols, names, paths, reports, cells_by_name, summary)
    if not conseq:
        return drift
    known = {k: (h, t, f) for k, h, t, _, f in FLIP_COLUMNS}
    known.update({k: (h, t, f) for k, h, t, f in CORRECTNESS})
    known.update({k: (h, t, f) for k, h, t, _, f in OPTIONAL_COLUMNS})
    ccols = [(k, *known[k]) for k in conseq]
    return (drift + '<h3 id="consequences-title">What the drift does</h3><p class="note">Branches from top-1 flips (each continued '
            "greedily by the candidate and classified) and the labelled items answered free-running by both models; counts, "
            "so sorting works as in the table above.</p>"
            + _table_html("consequences", ccols, names, paths, reports, cells_by_name, summary, badges=False))


# matrix cell -> the interval columns of report.json (bounded methods, docs/bounds.md)
INTERVAL_OF = {"kl_mean": "kl", "kl_rev_mean": "kl_rev", "jsd_mean": "jsd"}


def _interval_sub(rep: dict, key: str) -> str:
    """The proven interval of an approximated mean and its method, for the same cell."""
    name = INTERVAL_OF.get(key)
    s = rep.get("summary") or {}
    if name is None or f"{name}_lower_nats_mean" not in s:
        return ""
    lo, hi = _num(s.get(f"{name}_lower_nats_mean")), _num(s.get(f"{name}_upper_nats_mean"))
    method = _get(rep, "method.bounds")
    floor = _get(rep, "method.logprob_floor_nats")
    stated = "" if floor is None else f" · floor {_e(fmt(floor))}"
    return (f'<small class="interval" title="proven interval of the mean: contains the exact full-vocabulary value">'
            f"proven interval [{fmt(lo)}, {'inf' if hi is None else fmt(hi)}] · {_e(method)}{stated}</small>")


def _p(p) -> str:
    v = _num(p)
    return "n/a" if v is None else ("p < 0.001" if v < 0.001 else f"p = {v:.2g}")


def _verdict(a: str, b: str, r: dict | None, kind: str) -> str:
    """One table cell: the paired difference b − a with its CI, and what it allows to say."""
    if not r or r.get("diff") is None:
        return "<td>n/a</td>"
    lo, hi = r["ci"]
    if lo is None or hi is None:
        # One item or --bootstrap 0: no interval and no p-value, so no ordering was tested;
        # "cannot order" would read as a tested, inconclusive result.
        return (f'<td data-v="{r["diff"]!r}">{fmt(r["diff"], kind)} <small>no interval</small></td>'
                f'<td class="say">not evaluated: no interval (one item, or --bootstrap 0)</td>')
    diff = f"{fmt(r['diff'], kind)} <small>[{fmt(lo, kind)}, {fmt(hi, kind)}] · {_p(r['p_two_sided'])}</small>"
    if r["separable"]:
        more, less = (b, a) if r["diff"] > 0 else (a, b)
        say = f"<b>{_e(more)}</b> drifts more than <b>{_e(less)}</b>"
    else:
        need = r.get("items_needed")
        say = (f"cannot order {_e(a)} and {_e(b)} with {r['n_items']} items; "
               + ("no difference observed" if need is None or math.isinf(need) else f"~{int(need)} items would likely settle it"))
    return f'<td data-v="{r["diff"]!r}">{diff}</td><td class="say">{say}</td>'


def pairs_bootstrap(reports: Sequence[Report]) -> tuple[int, int, bool]:
    """(resamples, seed, mixed) of the page's paired bootstrap: the reports' own --bootstrap
    and --seed (method.bootstrap), so the page claims no interval its reports did not ask
    for. Reports made with different settings (mixed): the fewest resamples, and the first
    report's seed."""
    boots = [_get(r, "method.bootstrap") or {} for r in reports]
    ns = sorted({int(b["n"]) for b in boots if isinstance(b.get("n"), int)})
    seed = next((int(b["seed"]) for b in boots if isinstance(b.get("seed"), int)), 0)
    return (ns[0] if ns else DEFAULT_BOOTSTRAP), seed, len(ns) > 1


def _pairs_html(pairs, n_items, n_boot: int, seed: int, mixed: bool = False) -> str:
    if not pairs:
        return '<p class="note">One candidate: nothing to order.</p>'
    rows = "".join(
        f'<tr><td><code>{_e(p["a"])}</code> → <code>{_e(p["b"])}</code></td>'
        + _verdict(p["a"], p["b"], p.get("kl"), "g") + _verdict(p["a"], p["b"], p.get("top1"), "pct") + "</tr>"
        for p in pairs
    )
    if n_boot > 0:
        how = (f"a paired bootstrap over {n_items} items ({n_boot:,} resamples, seed {seed}"
               + (", the fewest of the reports' --bootstrap settings" if mixed else "")
               + ") of the difference of per-item means (b − a), 95 % CI.")
    else:
        how = ("the difference of per-item means (b − a); not evaluated: no 95 % CIs (--bootstrap 0), so no pair "
               "is ordered.")
    return ('<p class="note">Neighbours in the order of mean item KL, compared on the same items: '
            f'{how}</p>'
            '<div class="scroll"><table id="pairs"><thead><tr><th>a → b</th><th>Δ mean item KL</th><th></th>'
            "<th>Δ item top-1 disagr.</th><th></th></tr></thead><tbody>" + rows + "</tbody></table></div>")


def _shade(kl: float | None) -> float:
    if not kl or not math.isfinite(kl) or kl <= SHADE_LO:
        return 0.0
    a = (math.log10(kl) - math.log10(SHADE_LO)) / (math.log10(SHADE_HI) - math.log10(SHADE_LO))
    return round(min(1.0, a) * 0.85, 3)


def _show(tok) -> str:
    """A token for a tooltip: readable and quoted, with control characters spelled out."""
    t = readable_token(tok)
    return "'" + t.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") + "'"


def _top5_line(cols, side: str, j: int) -> str | None:
    """``'name' 3.17 % · 'f' 1.59 % · …`` for one model at position j; None without top-5 columns.

    Token strings come from ``top5_<side>_tokens`` (tokens.parquet); report.json rows carry
    only ids, which are then shown as ``#id``."""
    if f"top5_{side}_p" not in cols or (f"top5_{side}_tokens" not in cols and f"top5_{side}_ids" not in cols):
        return None
    ps = cols[f"top5_{side}_p"][j]
    toks = cols[f"top5_{side}_tokens"][j] if f"top5_{side}_tokens" in cols else None
    ids = cols[f"top5_{side}_ids"][j] if f"top5_{side}_ids" in cols else None
    if ps is None or (toks is None and ids is None):
        return None
    out = []
    for k, p in enumerate(ps):
        if toks is not None and k < len(toks):
            t = _show(toks[k])
        elif ids is not None and k < len(ids):
            t = f"#{int(ids[k])}"
        else:
            continue
        v = _num(p)
        out.append(f"{t} {'n/a' if v is None else f'{100 * v:.2f} %'}")
    return " · ".join(out) or None


def _token_view(name, rep, cols, worst_ids, *, open_: bool) -> str:
    items = {str(x.get("id")): x for x in rep.get("items") or []}
    ids = np.asarray(cols["item_id"]).astype(str)
    parts = []
    for iid in worst_ids:
        sel = np.flatnonzero(ids == iid)
        sel = sel[np.argsort(np.asarray(cols["position"])[sel], kind="stable")]
        spans = []
        for j in sel:
            tok = readable_token(cols["token"][j]) if "token" in cols else f"<{cols['token_id'][j]}>"
            kl = _num(cols["kl_nats"][j])
            flip = "top1_match" in cols and not bool(cols["top1_match"][j])
            tip = [f"position {int(cols['position'][j])} · KL {fmt(kl)} nats"]
            if "p_ref_token" in cols:
                tip.append(f"teacher {_show(cols['token'][j]) if 'token' in cols else ''}: p_ref {fmt(cols['p_ref_token'][j])}, "
                           f"p_cand {fmt(cols['p_cand_token'][j]) if 'p_cand_token' in cols else 'n/a'}")
            top5 = [_top5_line(cols, side, int(j)) for side in ("ref", "cand")]
            if all(top5):
                # Both models' five most likely tokens with their probabilities, most likely first.
                tip.append(f"reference top-5: {top5[0]}" + ("  ← FLIP" if flip else ""))
                tip.append(f"candidate top-5: {top5[1]}")
            elif "reference_top_token" in cols and "candidate_top_token" in cols:
                tip.append(f"reference top-1 {_show(cols['reference_top_token'][j])} · candidate top-1 {_show(cols['candidate_top_token'][j])}"
                           + ("  ← FLIP" if flip else ""))
            if "margin_ref" in cols:
                tip.append(f"ref margin p1−p2 {fmt(cols['margin_ref'][j])}")
            text = tok.replace("\n", "↵\n") if tok else "∅"
            spans.append(f'<span{" class=flip" if flip else ""} style="--a:{_shade(kl)}" title="{_e(chr(10).join(tip))}">{_e(text)}</span>')
        it = items.get(iid, {})
        t1 = it.get("top1_disagreement") or {}
        head = (f"<code>{_e(iid)}</code> {_e(' '.join('#' + t for t in it.get('tags') or []))} — mean KL {fmt(_get(it, 'kl_nats.mean'))} nats, "
                f"max {fmt(_get(it, 'kl_nats.max'))}; top-1 flips {fmt(t1.get('mismatches'))} of {fmt(it.get('n'))}")
        parts.append(f'<h3>{head}</h3><div class="toks mono">{"".join(spans)}</div>')
    return (f'<details{" open" if open_ else ""}><summary>{_e(name)}: {len(worst_ids)} items with the highest mean KL</summary>'
            + "".join(parts) + "</details>")


def _machine_text(m: dict) -> str:
    cpu = f"{m.get('cpu')} ({m['simd']})" if m.get("cpu") and m.get("simd") else m.get("cpu")
    return ", ".join(str(x) for x in (cpu, f"{m.get('cpu_count')} cores" if m.get("cpu_count") else None,
                                       f"{m.get('memory_gib')} GiB" if m.get("memory_gib") else None, m.get("platform"),
                                       f"Python {m['python']}" if m.get("python") else None) if x)


def _marks(r: dict) -> dict:
    m = r.get("marks")
    if isinstance(m, str):
        try:
            m = json.loads(m)
        except ValueError:
            m = None
    return m if isinstance(m, dict) else {}


def _evidence(text: str, marks: list | None) -> str:
    """A continuation with its flip token outlined, the stretch joined to the other
    continuation (from the re-join to where it left) green and what follows a departure red.
    ``marks`` = [end of the flip token, re-join, left again] in characters (None: absent)."""
    if not marks or len(marks) != 3:
        return _e(text)
    n = len(text)
    flip_end, rejoin, left = (None if x is None else max(0, min(int(x), n)) for x in marks)
    flip_end = flip_end or 0
    out = [f'<span class="ftok" title="flip token">{_e(text[:flip_end])}</span>']
    if rejoin is None:
        out.append(_e(text[flip_end:]))
        return "".join(out)
    rejoin = max(rejoin, flip_end)
    stop = n if left is None else max(left, rejoin)
    out.append(_e(text[flip_end:rejoin]))
    out.append(f'<span class="joined" title="joined to the other continuation">{_e(text[rejoin:stop])}</span>')
    if left is not None:
        out.append('<span class="cut" title="left again here"></span>'
                   f'<span class="left" title="after leaving for good">{_e(text[stop:])}</span>')
    return "".join(out)


def _where(r: dict) -> str:
    if "rejoin_position" not in r:
        return ""
    if r.get("rejoin_position") is None:
        return "no re-join"
    out = f"re-joined at {r['rejoin_position']} (reference {r.get('rejoin_ref_position')})"
    if r.get("left_position") is not None:
        out += f", left at {r['left_position']} (reference {r.get('left_ref_position')})"
    else:
        out += ", stayed"
    if r.get("joined_share") is not None:
        out += f"; {100 * r['joined_share']:.0f} % joined"
    return out


def _flips_view(name, rep, *, open_: bool) -> str:
    """report.json flips.top: the most consequential branches and examples of every outcome,
    both continuations side by side with the flip token, the re-join and the departure marked."""
    f = rep.get("flips") or {}
    top = f.get("top") or []
    notes = _flips_notes(f)
    if not top and not notes:
        return ""
    rows = []
    for r in top:
        m = _marks(r)
        rows.append(
            f"<tr id=\"{flip_anchor(name, r.get('item_id'), r.get('position'))}\"><td><code>{_e(r.get('item_id'))}</code></td>"
            f"<td class=num>{_e(r.get('position'))}</td>"
            f"<td><span class=\"outcome {_e(r.get('outcome'))}\">{_e(r.get('outcome'))}</span></td>"
            f"<td class=num>{fmt(r.get('kl_nats'))}</td><td class=num>{fmt(r.get('margin_ref'))}</td>"
            f"<td class=mono>{_e(_show(r.get('ref_token')))} → {_e(_show(r.get('cand_token')))}</td>"
            f"<td class=\"mono cont\">{_evidence(r.get('ref_continuation', ''), m.get('ref'))}</td>"
            f"<td class=\"mono cont\">{_evidence(r.get('branch_continuation', ''), m.get('branch'))}</td>"
            f"<td class=say>{_e(_where(r))}<small>{_e(r.get('decided_by', ''))}</small></td></tr>"
        )
    head = ("<tr><th>item</th><th>pos</th><th>outcome</th><th>KL</th><th>reference margin</th><th>reference → candidate token</th>"
            "<th>reference continues</th><th>candidate continues</th><th>re-join, departure; decided by</th></tr>")
    ties = f.get("ties") or {}
    tie_note = ""
    if f.get("n_ties"):
        listed = ", ".join(f"{t.get('item_id')}@{t.get('position')} {_show(t.get('ref_token'))}/{_show(t.get('cand_token'))}"
                           for t in (ties.get("list") or [])[:12])
        tie_note = (f'<p class="note">{_e(f.get("n_ties"))} ties at the reference ({_e(ties.get("tolerance", ""))}): the engines '
                    f"broke a tie, the candidate did not flip; not branched by default and not counted above or in gates. {_e(listed)}</p>")
    table = f'<div class="scroll"><table class="flips">{head}{"".join(rows)}</table></div>' if rows else ""
    judge = f.get("meaning_judged_by")
    meaning = ('<p class="note meaning">Meaning ' + (f"judged by {_e(judge)} (benign / meaning_changed of diverged branches)."
                                                      if judge else "not judged (no --judge): a branch that did not come back "
                                                      "on an item without a checker is diverged, with what was observed.") + "</p>")
    return (f'<details{" open" if open_ else ""}><summary>{_e(name)}: {len(top)} of '
            f'{_e(f.get("n_branches"))} branches ({_e(f.get("selection", ""))})</summary>{meaning}{notes}{tie_note}{table}</details>')


def _flips_notes(f: Mapping[str, Any]) -> str:
    """What the branches do not show, from the flips section (schema 1.2 fields, read by
    name and skipped when absent): the items whose answer or tool call changed and the flip
    branched behind each (or why none was), the flips the cap left out, the reference's
    self-consistency, and outputs cut at the token budget."""
    out = []
    changed = [c for c in f.get("changed_items") or [] if isinstance(c, dict)]
    if changed:
        each = []
        for c in changed:
            where = (f"branched at {c.get('position')} → {c.get('outcome')}" if c.get("branched")
                     else f"not branched: {c.get('why_not') or 'no flip selected'}")
            each.append(f"<code>{_e(c.get('item_id'))}</code> {_e(c.get('change'))} ({_e(where)})")
        n_un = sum(not c.get("branched") for c in changed)
        out.append(f'<p class="note changed-items"><b>Answers or tool calls that changed: {len(changed)}</b>'
                   f'{f", {n_un} without a branched flip" if n_un else ", each with its flip branched"}: ' + "; ".join(each) + "</p>")
    lo = f.get("left_out")
    if isinstance(lo, dict) and lo.get("n"):
        listed = ", ".join(f"{_e(x.get('item_id'))}@{_e(x.get('position'))} (KL {fmt(x.get('kl_nats'))})" for x in (lo.get("list") or [])[:20])
        more = f" (first {min(20, len(lo.get('list') or []))} listed)" if lo["n"] > 20 else ""
        out.append(f'<p class="note left-out"><b>Left out by the --max-branches cap: {_e(lo["n"])} selected flips</b> in '
                   f'{_e(lo.get("n_items", "?"))} items, not branched{more}: {listed}</p>')
    rs = f.get("reference_self_consistency")
    if isinstance(rs, dict) and rs.get("n_written_not_top1"):
        rate = _num(rs.get("rate"))
        out.append(f'<p class="note ref-consistency">Reference self-consistency: at {_e(rs["n_written_not_top1"])} of '
                   f'{_e(rs.get("n_positions"))} positions{f" ({100 * rate:.2f} %)" if rate is not None else ""} the token the '
                   "reference wrote is not its own scored top-1 (generation and scoring ran in other batch shapes)"
                   + (f"; at {_e(rs['n_candidate_wrote_it'])} of them the candidate picked the written token: not a flip, not branched"
                      if rs.get("n_candidate_wrote_it") is not None else "") + ".</p>")
    j = f.get("judge")
    if isinstance(j, dict):
        from .markdown import judge_line

        out.append(f'<p class="note judge"><b>Judge</b>: {_e(judge_line(j).removeprefix("- judge of the diverged branches: "))}</p>')
    oc = f.get("outputs_cut")
    if isinstance(oc, dict) and (oc.get("reference_cut") or oc.get("branches_cut")):
        out.append(f'<p class="note outputs-cut">Cut at the token budget: {_e(oc.get("reference_cut"))} of {_e(oc.get("n_items"))} '
                   f'reference outputs and {_e(oc.get("branches_cut"))} of {_e(oc.get("n_branches"))} branches.</p>')
    return "".join(out)


# ----------------------------------------------------------------------------- page
def _names(reports, paths) -> list[str]:
    raw = [Path(p).name if p else str(_get(r, "candidate.spec") or _get(r, "candidate.served_model") or f"candidate {i + 1}")
           for i, (r, p) in enumerate(zip(reports, paths))]
    seen: dict[str, int] = {}
    out = []
    for n in raw:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def render_html(
    reports: list[Report],
    tokens: list | None = None,
    *,
    title: str | None = None,
    summary: RunSummary | None = None,
    paths: Sequence[str | Path | None] | None = None,
    plotly_src: str | None = None,
) -> str:
    """The page for ``reports`` (report.json objects) and their tokens: self-contained, or
    loading plotly.js from ``plotly_src`` (a URL relative to the page: a RUN's shared file).

    ``tokens[i]`` is report i's tokens.parquet as a pandas DataFrame or a mapping of
    columns, or None (then report.json rows are used when present, and token-based parts
    are left out otherwise). ``summary`` is an optional run summary.json (cross-engine
    floor, workload path). ``paths`` name the report directories, for labels and errors.

    In steps: the inputs checked (one page, one measurement), the numbers the page computes
    from tokens (``logitdiff-data``), the figures, the worst items' token views, the page.
    """
    if not reports:
        raise LogitdiffError("logitdiff report: no reports given")
    reports = [migrate_report(r) if r.get("schema") == REPORT_SCHEMA_1 else r for r in reports]  # 1.x objects given as they are
    tokens = list(tokens) if tokens is not None else [None] * len(reports)
    if len(tokens) != len(reports):
        raise ValueError("tokens must have one entry per report")
    paths_text = [None if p is None else str(p) for p in (paths or [None] * len(reports))]
    cols = [token_columns(t) if t is not None else _rows_as_columns(r) for r, t in zip(reports, tokens)]
    labels = [p or str(_get(r, "candidate.spec") or f"report {i + 1}") for i, (r, p) in enumerate(zip(reports, paths_text))]
    check_reports_on_one_page(reports, cols, labels)
    names = _names(reports, paths_text)

    cells, conseq = matrix_data(names, reports, summary)
    data: dict = {"schema": HTML_DATA_SCHEMA, "generator": f"logitdiff {__version__}", "candidates": names,
                  "reports": labels, "matrix": cells, "kl_cdf": {}, "ref_confidence": {}, "worst_items": {}}
    buckets, conf_label = _token_figures_data(names, cols, data)
    item_ids = [str(x.get("id")) for x in reports[0].get("items") or []]
    if not item_ids and cols[0] is not None:
        item_ids = sorted(set(np.asarray(cols[0]["item_id"]).astype(str)))
    ikl, it1 = _item_arrays(reports, cols, names, item_ids)
    n_boot, boot_seed, boot_mixed = pairs_bootstrap(reports)
    pairs = adjacent_pairs(item_ids, ikl, it1, n_boot=n_boot, seed=boot_seed) if len(ikl) >= 2 else []
    data["pairs"] = pairs
    data["pairs_bootstrap"] = {"n": n_boot, "seed": boot_seed}
    data["gates"] = {n: r["gates"] for n, r in zip(names, reports) if r.get("gates")}
    data["pareto"] = _pareto_data(names, cells)

    figs, omitted = build_figures(names, reports, data["kl_cdf"], buckets, conf_label, data["pareto"])
    views, worst_cand = _worst_item_views(names, reports, cols, cells, ikl, item_ids, data)
    title = title or f"logitdiff: drift from {_get(reports[0], 'reference.spec') or 'the reference'}"
    parts = {
        "verdicts": _verdicts_html(names, reports, cells, summary),
        "matrix": _matrix_html(names, [p or "" for p in paths_text], reports, cells, conseq, summary),
        "setup": _header(names, paths_text, reports, summary),
        "pairs": _pairs_html(pairs, len(item_ids), n_boot, boot_seed, boot_mixed),
        "plots": "".join(f'<div class="plotbox"><div id="{f["id"]}" class="plot"></div><p class="note">{_e(f["note"])}</p></div>'
                         for f in figs),
        "omitted": "".join(f'<p class="note">Not shown: {_e(o)}.</p>' for o in omitted),
        "flips": _flips_section(names, reports, worst_cand),
        "tokens": "".join(_token_view(n, r, c, o, open_=(n == worst_cand)) for n, r, c, o in views)
        or '<p class="note">No tokens.parquet: no token view.</p>',
    }
    shown = {str(r.get("outcome")) for rep in reports for r in _get(rep, "flips.top") or []}
    shown |= set(Outcome.occurring(*(_get(r, "flips.outcomes") for r in reports)))
    return _page(title, parts, data, [{"id": f["id"], "data": f["data"], "layout": f["layout"]} for f in figs], plotly_src=plotly_src,
                 css=outcome_css([o for o in OUTCOME_COLORS if o in shown]) + CSS)


def _token_figures_data(names, cols, data: dict) -> tuple[dict, str | None]:
    """Per candidate with tokens, into ``data``: the KL CDF and the reference-confidence
    buckets; returns (buckets by candidate, the confidence column's label)."""
    buckets, conf_label = {}, None
    for name, c in zip(names, cols):
        if c is None or "kl_nats" not in c:
            continue
        data["kl_cdf"][name] = kl_cdf(c["kl_nats"])
        conf, conf_label, left_out = ref_confidence(c)
        b = bucket_stats(conf, c)
        b["left_out"] = left_out
        buckets[name] = b
    if buckets:
        data["ref_confidence"] = {"column": conf_label, "edges": list(REF_CONF_EDGES), "by_candidate": buckets}
    return buckets, conf_label


def _pareto_data(names, cells) -> dict:
    """The candidates with a file size and a mean KL, and the size/KL Pareto frontier among them."""
    pts: list[dict[str, Any]] = [{"name": n, "size": _num(cells[n]["file_size"]["value"]), "kl_mean": _num(cells[n]["kl_mean"]["value"])}
                                 for n in names]
    pts = [p for p in pts if p["size"] and p["kl_mean"]]
    return {"points": pts, "front": pareto_front([(p["name"], p["size"], p["kl_mean"]) for p in pts])}


def _worst_item_views(names, reports, cols, cells, ikl, item_ids, data: dict) -> tuple[list[tuple], str]:
    """Token views of the worst items by item mean KL, for every candidate with tokens, the
    worst candidate first (its view open); ``data["worst_items"]`` gets each candidate's list."""
    kl_of = {n: (_num(cells[n]["kl_mean"]["value"]) or 0.0) for n in names}
    worst_cand = max(names, key=lambda n: kl_of[n])
    views = []
    for name, rep, c in zip(names, reports, cols):
        if c is None or "kl_nats" not in c:
            continue
        arr = ikl.get(name)
        if arr is None or not len(arr):
            continue
        order = [item_ids[k] for k in np.argsort(-np.nan_to_num(arr, nan=-np.inf), kind="stable")[:WORST_ITEMS]]
        data["worst_items"][name] = [{"id": i, "kl_mean": float(arr[item_ids.index(i)])} for i in order]
        views.append((name, rep, c, order))
    views.sort(key=lambda v: -kl_of[v[0]])
    return views, worst_cand


def _flips_section(names, reports, worst_cand: str) -> str:
    """The section "What the flips do": every candidate's branches, when any report has some to show."""
    if not any((fl := r.get("flips")) and (fl.get("top") or _flips_notes(fl)) for r in reports):
        return ""
    return ('<h2 id="flips">What the flips do</h2><p class="note">Branches from top-1 flips: the most consequential '
            "(a tool call, tests or a checked answer changed, then diverged, then the rest; then KL) and examples of every "
            "outcome. The reference's "
            "own continuation beside the candidate's, from the flip on: <span class=\"cont\"><span class=\"ftok\">flip token</span></span> outlined, "
            "<span class=\"cont\"><span class=\"joined\">joined</span></span> from the re-join to where the branch "
            "<span class=\"cont\"><span class=\"cut\"></span><span class=\"left\">left again</span></span> "
            f"(report.json <code>flips.top</code>; every branch is in flips.parquet). {_e(FLIP_AGREEMENT_TEXT)}</p>"
            + "".join(_flips_view(n, r, open_=(n == worst_cand)) for n, r in zip(names, reports)))


# A RUN's shared plotly.js: OUT/PLOTLY_FILE, loaded by OUT/report.html and by each
# OUT/reports/<name>/report.html through a relative URL (plotly_src_for).
PLOTLY_FILE = "plotly.min.js"


def plotly_src_for(page_dir: str | Path, run_out: str | Path) -> str:
    """The URL, relative to a page in ``page_dir``, of the RUN ``run_out``'s shared plotly.js."""
    import os

    return Path(os.path.relpath(Path(run_out) / PLOTLY_FILE, Path(page_dir))).as_posix()


def plotly_js() -> str:
    """plotly.min.js as the installed plotly package ships it: inlined in a page written
    alone, the content of a RUN's shared OUT/plotly.min.js."""
    import plotly.offline

    return plotly.offline.get_plotlyjs()


def _plotly_head(plotly_src: str | None) -> tuple[str, str]:
    """(Content-Security-Policy, the plotly script tag): inlined, or loaded from ``plotly_src``
    (relative to the page), the only file the page may fetch: scripts from the page's own
    place ('self' under a web server, file: when opened from disk), nothing else."""
    base = "default-src 'none'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:"
    if plotly_src is None:
        return f"{base}; script-src 'unsafe-inline'", f'<script id="plotly-js">{plotly_js()}</script>'
    return f"{base}; script-src 'unsafe-inline' 'self' file:", f'<script id="plotly-js" src="{_e(plotly_src)}"></script>'


def with_plotly_src(page: str, plotly_src: str) -> str:
    """A page written with a shared plotly.js, pointing at it from another place (the same
    page copied to another directory of the RUN)."""
    tag = re.compile(r'<script id="plotly-js" src="[^"]*"></script>')
    if len(tag.findall(page)) != 1:
        raise ValueError("not a page that loads a shared plotly.js")
    return tag.sub(lambda _: f'<script id="plotly-js" src="{_e(plotly_src)}"></script>', page, count=1)


def _page(title: str, parts: dict[str, str], data: dict, fig_json: list[dict], *, plotly_src: str | None = None,
          css: str = CSS) -> str:
    """The page around its parts: head (CSP, plotly.js inlined or the shared file), sections, embedded data."""
    csp, plotly_tag = _plotly_head(plotly_src)
    missing = ("" if plotly_src is None else
               f'<p id="plotly-missing" class="note unevaluated" hidden>The plots are not drawn: {_e(plotly_src)} '
               "(the RUN's shared plotly.js, beside OUT/report.html) was not found or not loaded; keep the page in its RUN "
               "directory, or write a self-contained one with logitdiff report.</p>")
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        HTML_GENERATOR_META,  # how `report --out` recognises a page it may replace
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{css}</style>",
        plotly_tag,
        "</head><body>",
        f"<h1>{_e(title)}</h1>",
        missing,
        '<p class="lead">Drift of each candidate\'s next-token distributions from the reference, teacher-forced on the same tokens. '
        "The reference is a numerical-fidelity reference, not an oracle: these figures are <em>drift from the reference</em>, "
        "not correctness.</p>",
        '<h2 id="verdicts">Verdict</h2>',
        parts["verdicts"],
        '<h2 id="candidates">Candidates</h2>',
        '<p class="note">Click a header to sort. Means carry a 95 % CI from a bootstrap over items. '
        "Rows marked ⚠ are within 2× of a floor: their drift is not distinguishable from the floor's.</p>",
        parts["matrix"],
        '<h2 id="setup">What was compared</h2>',
        parts["setup"],
        "<h3>Can the candidates be ordered?</h3>",
        parts["pairs"],
        '<h2 id="plots">Plots</h2>',
        '<div class="grid2">' + parts["plots"] + "</div>",
        parts["omitted"],
        parts["flips"],
        '<h2 id="tokens">Worst items, token by token</h2>',
        f'<p class="note">Teacher text; each token shaded by its KL (<span class="legend"></span> {SHADE_LO:g} → {SHADE_HI:g} nats, log scale); '
        "<span style=\"outline:2px solid #1f4fd1\">outlined</span> tokens are top-1 flips. Hover a token for both models' top-5 "
        "tokens with their probabilities (top-1 only where the report has no top-5 columns) and the teacher token's probability "
        "under each. ↵ marks a newline.</p>",
        parts["tokens"],
        f'<footer>logitdiff {_e(__version__)} — report.json is the source of every number; the numbers computed here from tokens.parquet are in the '
        "embedded <code>logitdiff-data</code> JSON.</footer>",
        f'<script type="application/json" id="logitdiff-data">{_json_for_script(json_clean(data))}</script>',
        f'<script type="application/json" id="logitdiff-figures">{_json_for_script(json_clean(fig_json))}</script>',
        f"<script>{JS}</script>",
        "</body></html>\n",
    ])


def write_html(report_dirs: Sequence[str | Path], out: str | Path, summary: RunSummary | None = None, *, title: str | None = None,
               inputs: Sequence[str | Path] = (), plotly_src: str | None = None) -> Path:
    """Read each REPORT dir's report.json and tokens.parquet, write one page atomically
    (self-contained, or loading plotly.js from ``plotly_src``: :func:`render_html`)."""
    reports, tokens, paths = [], [], []
    for d in report_dirs:
        d = Path(d)
        if not (d / "report.json").is_file():
            raise LogitdiffError(f"{d}: not a REPORT directory (no report.json)")
        with same_directory(d):  # report.json and tokens.parquet of one version of the REPORT
            reports.append(load_report(d))
            tokens.append(load_tokens(d / "tokens.parquet"))
        paths.append(str(d))
    page = render_html(reports, tokens, title=title, summary=summary, paths=paths, plotly_src=plotly_src)
    out = Path(out)
    # out: new, or a page this tool wrote; never a directory, another file or an input.
    with writing(out, Kind.HTML, inputs=[*report_dirs, *inputs]) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return out
