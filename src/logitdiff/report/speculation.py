"""The generation-mode (speculation) report: report.json (schema ``logitdiff.speculation/1``),
report.md and a self-contained report.html (plotly inlined, as the other pages)."""

from __future__ import annotations

import html
import json

from ..contracts import SPECULATION_SCHEMA_VERSION, json_clean, validate, validation_on
from ..contracts import HTML_GENERATOR_META, SPECULATION_SCHEMA


def speculation_json(report: dict, where: str = "report.json") -> str:
    doc = json_clean({"schema": SPECULATION_SCHEMA, "schema_version": SPECULATION_SCHEMA_VERSION, **report})
    if validation_on():
        validate(doc, "speculation", where)
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def _f(x, fmt=".3g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _kl(x) -> str:
    """A KL with no positions behind it was never measured: say so, never print 0 or n/a."""
    return "not known (no finite value among the positions compared)" if x is None else format(x, ".3g")


def _f0_dlogprob(side: dict) -> str:
    """F0's largest |Δlogprob|; with no position compared, the reason (report.json's
    ``not_evaluated``), never 0."""
    if side.get("max_abs_dlogprob") is None:
        return side.get("not_evaluated") or "not evaluated: no positions compared"
    return f"max abs dlogprob {_f(side['max_abs_dlogprob'])}"


def _f0_bits(side: dict) -> str:
    """F0's bit-identity: null (nothing compared) reads 'not evaluated', never True."""
    b = side.get("bit_identical")
    return "bit-identical not evaluated" if b is None else f"bit-identical {b}"


def _f1_result(f1: dict) -> str:
    """F1's figures; with no position compared its reason (report.json's ``not_evaluated``)
    for the largest |Δlogprob| and the near-tie threshold (twice it), never 0."""
    if f1.get("max_abs_dlogprob") is None:
        why = f1.get("not_evaluated") or "not evaluated: no positions compared"
        return f"max abs dlogprob {why}; near-tie threshold not evaluated"
    return (f"max abs dlogprob {_f(f1['max_abs_dlogprob'])}, KL max {_kl(f1['kl_nats']['max'])}, "
            f"top-1 flips {f1['top1_flips']}; near-tie threshold {_f(f1['near_tie_nats'])} nats")


def _prefix(p: dict) -> str:
    """The aligned prefix's same-context figures; with no position compared, the reason
    (as compare's zero-position report does), never 'n/a' or 'not reported'."""
    if not p["positions_compared"]:
        return PREFIX_NOT_EVALUATED
    dl = p["abs_dlogprob"]["max"]
    return (f"{p['positions_compared']} positions where both sides reported; KL (top-K estimate) max {_kl(p['kl_nats']['max'])} "
            f"nats, proven lower bound max {_kl(p['kl_lower_nats']['max'])}, top-1 disagreements {p['top1_disagreements']}, "
            "max abs dlogprob " + (_f(dl) if dl is not None else
                                   "not evaluated: the next token is listed by both sides at none of these positions"))


PREFIX_NOT_EVALUATED = ("not evaluated: no positions compared (no aligned-prefix position where both sides reported a "
                        "probability): KL, top-1 and max abs dlogprob not evaluated")


MARGIN_UNKNOWN = "not known (no probability there, or the side's own token outside its top-K)"


def _margin(x, exact: bool = True) -> str:
    """A side's margin at a divergence; null with the reason, '(>=)' where a lower bound."""
    if x is None or x != x:  # null in report.json, NaN before it is written
        return MARGIN_UNKNOWN
    return _f(x) + ("" if exact else " (>=)")


def _cross(x: dict) -> str:
    """Cross-scoring after the divergences; with none, the reason, never 'n/a'."""
    if not x["items"]:
        return "not evaluated: no divergence to cross-score (every output identical)"
    return (f"{x['items']} items: reference tokens on the candidate server KL max {_kl(x['reference_on_candidate_kl_nats']['max'])}; "
            f"the reference agrees with the candidate's next token in its context at {_f(x['candidate_on_reference_top1_agreement'])}")


def _classes(s: dict) -> str:
    """The near-tie/material counts; null (F1 measured nothing) reads as its reason."""
    if s["near_tie_divergences"] is None:
        return (f"{s.get('unclassified_divergences', s['divergent_items'])} not classed near-tie or material, "
                f"{s.get('classes_not_evaluated') or 'not evaluated'}")
    return f"{s['near_tie_divergences']} near-tie, {s['material_divergences']} material"


def render_markdown(rep: dict) -> str:
    s, v, f0, f1 = rep["summary"], rep["verdict"], rep["floors"]["F0"], rep["floors"]["F1"]
    cc = rep["candidate"]["counters"]
    out = [
        "# Speculation on vs off: generation mode", "",
        f"**Verdict: {v['label']}**", "",
        *[f"- {r}" for r in v["reasons"]],
        *([""] + ["Defects:"] + [f"- {d}" for d in v["defects"]] if v["defects"] else []), "",
        f"Reference: `{rep['reference']['url']}` ({rep['reference'].get('model_path')}); "
        f"candidate: `{rep['candidate']['url']}` ({rep['candidate'].get('model_path')}), declared speculative: "
        f"{rep['candidate']['declared_speculative']}.", "",
        f"Greedy generation from the same prompt token ids, {rep['method']['n_predict']} tokens each (EOS ignored), one request at "
        f"a time, prompt cache off, top-{rep['method']['top_logprobs']} logprobs. Every figure is read against the floors.", "",
        "## Floors", "",
        "| floor | what | result |", "| --- | --- | --- |",
        f"| F0 reference | rerun of itself, {f0['reference']['items']} items | identical outputs {f0['reference']['identical_outputs']}, "
        f"{_f0_dlogprob(f0['reference'])}, {_f0_bits(f0['reference'])} |",
        f"| F0 candidate | rerun of itself | identical outputs {f0['candidate']['identical_outputs']}, "
        f"{_f0_dlogprob(f0['candidate'])}, {_f0_bits(f0['candidate'])} |",
        f"| F1 shape | reference tokens teacher-forced in width-{f1['shape_width']} prefill batches vs its decode logprobs, "
        f"{f1['positions']} positions | {_f1_result(f1)} |", "",
        "## Generation", "",
        f"- identical outputs: {100 * s['identical_output_rate']:.1f}% of {s['items']} items; mean shared-prefix fraction "
        f"{s['mean_shared_prefix_fraction']:.3f}",
        f"- divergences: {_classes(s)}",
        f"- drafting: {cc['draft_n_accepted']} of {cc['draft_n']} draft tokens accepted "
        f"(acceptance {_f(cc['acceptance_rate']) if cc['draft_n'] else 'not evaluated: nothing drafted'}); candidate probabilities "
        f"not reported at {cc['positions_not_reported']} of {cc['positions']} positions"
        + (f"; reference probabilities not reported at {rep['reference']['counters']['positions_not_reported']} of "
           f"{rep['reference']['counters']['positions']} positions (a measurement gap, not a speculation defect)"
           if rep["reference"]["counters"]["positions_not_reported"] else ""),
        f"- same context, aligned prefix: {_prefix(s['prefix'])}",
        f"- cross-scoring after divergences: {_cross(s['cross'])}", "",
        "## First divergences", "",
        "| item | first divergence | shared prefix | reference token | candidate token | reference margin (nats) | candidate margin (nats) | class |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rep["items"]:
        if r["identical"]:
            continue
        out.append(f"| {r['id']} | {r['first_divergence']} | {r['shared_prefix_fraction']:.3f} | {r['reference_token']} | "
                   f"{r['candidate_token']} | {_margin(r['reference_margin_nats'], r['reference_margin_exact'])} | "
                   f"{_margin(r['candidate_margin_nats'], r['candidate_margin_exact'])} | {r['class']} |")
    if all(r["identical"] for r in rep["items"]):
        out.append("| (none: every output identical) | | | | | | | |")
    t = rep["timing"]
    out += ["", f"Wall {t['wall_s']:.1f} s: generations {t['generations_s']:.1f} s, floors {t['floors_s']:.1f} s, "
            f"comparison {t['compare_s']:.1f} s; the servers' own generation time {t['server_generation_s']:.1f} s.", ""]
    return "\n".join(out)


def render_html(rep: dict) -> str:
    import plotly.offline

    n = rep["method"]["n_predict"]
    xs = list(range(n))
    sv = rep["survival"]
    # a floor over no items has a survival of 1 everywhere by definition: drawn, it would read
    # as a measured perfect floor, so it is left out and the legend says why
    f0, f1 = rep["floors"]["F0"], rep["floors"]["F1"]
    measured = {"candidate": True, "F0_reference": bool(f0["reference"]["items"]), "F0_candidate": bool(f0["candidate"]["items"]),
                "F1": bool(f1.get("items", f1["positions"]))}
    traces = [{"x": xs, "y": sv[k], "name": name, "mode": "lines", "line": {"dash": dash}} if measured[k] else
              {"x": [], "y": [], "name": f"{name}: not measured (no floor items)", "mode": "lines", "line": {"dash": dash}}
              for k, name, dash in (("candidate", "candidate vs reference", "solid"), ("F0_reference", "F0 reference rerun", "dot"),
                                    ("F0_candidate", "F0 candidate rerun", "dot"), ("F1", "F1 shape floor (teacher-forced)", "dash"))]
    fig = {"data": traces, "layout": {"title": {"text": "Survival: share of items still identical at position t"},
                                      "xaxis": {"title": {"text": "output position t"}}, "yaxis": {"title": {"text": "share"}, "range": [0, 1.05]},
                                      "template": "plotly_white", "height": 420}}
    md = render_markdown(rep)
    v = rep["verdict"]
    rows = "".join(
        f"<tr><td>{html.escape(str(r['id']))}</td><td>{r['first_divergence']}</td><td>{r['shared_prefix_fraction']:.3f}</td>"
        f"<td>{html.escape(_margin(r['reference_margin_nats'], r['reference_margin_exact']))}</td>"
        f"<td>{html.escape(_margin(r['candidate_margin_nats'], r['candidate_margin_exact']))}</td><td>{r['class']}</td></tr>"
        for r in rep["items"] if not r["identical"])
    data = json.dumps(json_clean({"schema": SPECULATION_SCHEMA, "verdict": v, "summary": rep["summary"]})).replace("</", "<\\/")
    return "\n".join([
        "<!doctype html>", "<html><head><meta charset='utf-8'>", HTML_GENERATOR_META,
        "<title>logitdiff: speculation on vs off</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        "pre{white-space:pre-wrap;background:#f6f6f6;padding:8px}</style>",
        f"<script>{plotly.offline.get_plotlyjs()}</script></head><body>",
        f"<h1>Speculation on vs off: {html.escape(v['label'])}</h1>",
        "<ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in v["reasons"]) + "</ul>",
        ("<h3>Defects</h3><ul>" + "".join(f"<li>{html.escape(d)}</li>" for d in v["defects"]) + "</ul>") if v["defects"] else "",
        "<div id='survival'></div>",
        "<h2>First divergences</h2><table><tr><th>item</th><th>first divergence</th><th>shared prefix</th><th>reference margin</th>"
        f"<th>candidate margin</th><th>class</th></tr>{rows}</table>",
        f"<h2>Report</h2><pre>{html.escape(md)}</pre>",
        f"<script type='application/json' id='logitdiff-data'>{data}</script>",
        f"<script>Plotly.newPlot('survival', {json.dumps(fig['data'])}, {json.dumps(fig['layout'])});</script>",
        "</body></html>", ""])
