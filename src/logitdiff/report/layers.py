"""layers.md and layers.html of ``logitdiff layers`` (:mod:`logitdiff.layers`): rendered from
the layers.json object alone."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..contracts import LayersDoc


def _g(x, spec=".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "inf" if isinstance(x, float) and x == math.inf else "n/a"
    return format(x, spec)


def _script_json(obj) -> str:
    """JSON for inside a ``<script>`` element: ``<``, ``>`` and ``&`` as ``\\u`` escapes, which
    JSON strings read back as the same characters. Escaping ``</`` alone is not enough: a name
    holding ``<!--<script>`` switches the HTML parser into the script's double-escaped state,
    where the element's own ``</script>`` no longer ends it and no plot is drawn."""
    import json

    return json.dumps(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_markdown(doc: LayersDoc) -> str:
    """layers.md: per candidate, the first layer beyond the floor, the layers that add the
    most error, and the per-layer table."""
    names = doc["geometry"]["points"]
    floor = doc.get("floor")
    lines = [f"# Where the drift starts: per-layer error against {doc['reference']['spec']}", "",
             f"{doc['n_positions']} teacher-forced positions of {doc['n_items']} items of `{doc['teacher']}`; "
             f"{doc['geometry']['family']} family, {doc['geometry']['n_layer']} layers, H = {doc['geometry']['hidden_size']}.", "",
             f"Floor: {doc['method']['floor']}." + (" The floor run was bit-identical to the reference (band 0)." if floor and floor["identical"] else ""),
             "", "| candidate | mean KL (nats) | first layer beyond the floor | layers adding the most error (median added rel L2) |",
             "|---|---:|---|---|"]
    for c in doc["candidates"]:
        first = c["first_beyond_floor"]
        ad = c["per_point"]["added_rel_l2_median"]
        tops = ", ".join(f"{names[j]} (+{_g(ad[j])})" for j in c["top_added"]) or "none"
        lines.append(f"| `{c['spec']}` | {_g(c['kl_mean_nats'])} | {names[first] if first is not None else ('no floor' if floor is None else 'none')} | {tops} |")
    for c in ([floor] if floor else []) + doc["candidates"]:
        p = c["per_point"]
        lines += ["", f"## `{c['spec']}`" + (" (floor)" if c is floor else ""), "",
                  "| point | rel L2 median | rel L2 p95 | added rel L2 median | cosine median | SQNR median (dB) | growth | ρ(rel L2, KL) median over items |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for j, n in enumerate(names):
            mark = " ◀ leaves floor" if c is not floor and c["first_beyond_floor"] == j else ""
            lines.append(f"| {n}{mark} | {_g(p['rel_l2_median'][j])} | {_g(p['rel_l2_p95'][j])} | {_g(p['added_rel_l2_median'][j])} | {_g(p['cosine_median'][j], '.6f')} | "
                         f"{_g(p['sqnr_db_median'][j], '.1f')} | {_g(p['growth'][j])} | {_g(p['spearman_kl_median'][j], '.2f')} |")
    return "\n".join(lines) + "\n"


def render_html(doc: LayersDoc) -> str:
    """layers.html: one self-contained page (plotly inlined): error per layer (median solid,
    p95 dotted, one colour per candidate, the floor band shaded), the error each layer adds, and the
    median over items of the per-item correlation between a layer's error and the final KL."""
    import json
    import html as H

    import plotly.graph_objects as go
    import plotly.offline

    from ..contracts import HTML_GENERATOR_META

    names = doc["geometry"]["points"]
    x = list(range(len(names)))
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
    floor = doc.get("floor")

    def pos(v):  # log axes: zeros and non-finite values are gaps
        return [None if (y is None or not math.isfinite(y) or y <= 0) else y for y in v]

    err = go.Figure()
    if floor:
        fp = floor["per_point"]
        err.add_trace(go.Scatter(x=x, y=pos(fp["rel_l2_p95"]), mode="lines", line={"color": "rgba(120,120,120,0.5)"},
                                 fill="tozeroy", fillcolor="rgba(160,160,160,0.25)", name="floor band (p95)"))
        err.add_trace(go.Scatter(x=x, y=pos(fp["rel_l2_median"]), mode="lines", line={"color": "gray", "dash": "dash"}, name="floor median"))
    for k, c in enumerate(doc["candidates"]):
        col = palette[k % len(palette)]
        p = c["per_point"]
        err.add_trace(go.Scatter(x=x, y=pos(p["rel_l2_median"]), mode="lines+markers", line={"color": col}, name=f"{c['spec']} median"))
        err.add_trace(go.Scatter(x=x, y=pos(p["rel_l2_p95"]), mode="lines", line={"color": col, "dash": "dot"}, name=f"{c['spec']} p95",
                                 showlegend=True))
        if c["first_beyond_floor"] is not None:
            j = c["first_beyond_floor"]
            err.add_trace(go.Scatter(x=[j], y=pos([p["rel_l2_median"][j]]), mode="markers", marker={"symbol": "star", "size": 14, "color": col},
                                     name=f"{c['spec']}: leaves the floor at {names[j]}"))
    err.update_yaxes(type="log", title="relative L2 error of the residual stream")
    gro = go.Figure()
    cor = go.Figure()
    for k, c in enumerate(doc["candidates"]):
        col = palette[k % len(palette)]
        gro.add_trace(go.Bar(x=x, y=pos(c["per_point"]["added_rel_l2_median"]), name=c["spec"], marker_color=col))
        cor.add_trace(go.Scatter(x=x, y=c["per_point"]["spearman_kl_median"], mode="lines+markers", name=c["spec"], line={"color": col}))
    gro.update_yaxes(type="log", title="median added rel L2 (|e - e_prev| / |r|)")
    cor.update_yaxes(title="Spearman ρ(rel L2, final KL), median over items", range=[-1, 1])
    figs = []
    for fid, title, f in (("err", "Error per layer (median solid, p95 dotted; floor shaded)", err),
                          ("added", "Error each layer adds: median |e - e_prev| / |r| (the layers that add the most error)", gro),
                          ("corr", "Does a layer's error predict the final KL? (per item, median over items)", cor)):
        f.update_layout(title={"text": title, "x": 0.01}, template="plotly_white", height=460,
                        xaxis={"tickmode": "array", "tickvals": x, "ticktext": names, "title": "point (residual stream after)"},
                        legend={"font": {"size": 11}}, margin={"l": 70, "r": 20, "t": 50, "b": 60})
        d = json.loads(f.to_json())
        figs.append({"id": fid, "data": d["data"], "layout": d["layout"]})
    rows = []
    for c in doc["candidates"]:
        first = c["first_beyond_floor"]
        tops = ", ".join(f"{names[j]} (+{_g(c['per_point']['added_rel_l2_median'][j])})" for j in c["top_added"]) or "none"
        rows.append(f"<tr><td><code>{H.escape(c['spec'])}</code></td><td>{_g(c['kl_mean_nats'])}</td>"
                    f"<td>{H.escape(names[first]) if first is not None else ('no floor' if floor is None else 'none')}</td><td>{H.escape(tops)}</td></tr>")
    script = "".join(f"Plotly.newPlot({_script_json(f['id'])}, {_script_json(f['data'])}, {_script_json(f['layout'])}, {{responsive: true}});"
                     for f in figs)
    csp = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:"
    title = f"logitdiff layers: where the drift from {doc['reference']['spec']} starts"
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">", HTML_GENERATOR_META,
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        f"<title>{H.escape(title)}</title><style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}.note{color:#555}</style>",
        f'<script id="plotly-js">{plotly.offline.get_plotlyjs()}</script></head><body>',
        f"<h1>{H.escape(title)}</h1>",
        f"<p class=\"note\">{doc['n_positions']} teacher-forced positions of {doc['n_items']} items of <code>{H.escape(doc['teacher'])}</code>; "
        f"{H.escape(doc['geometry']['family'])} family, {doc['geometry']['n_layer']} layers, H = {doc['geometry']['hidden_size']}. "
        f"Floor: {H.escape(doc['method']['floor'])}. {H.escape(doc['method']['beyond_floor'])}.</p>",
        "<table><tr><th>candidate</th><th>mean KL (nats)</th><th>first layer beyond the floor</th><th>layers adding the most error (median added rel L2)</th></tr>",
        "".join(rows), "</table>",
        "".join(f'<div id="{f["id"]}" style="height:460px"></div>' for f in figs),
        f"<script>{script}</script></body></html>\n",
    ])
