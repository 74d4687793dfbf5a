"""report.md: the same numbers as report.json, for people."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..contracts import AnswerChange, Correctness, Flips, Outcome, Report
from .metric_registry import header
from .metric_registry import SERIES
from .verdict import attributed_text, verdict_text


def _f(x, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e5:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}f}"
    return str(x)


def _ci(d) -> str:
    ci = (d or {}).get("ci95") or [None, None]
    return f"[{_f(ci[0])}, {_f(ci[1])}]"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def group_table(rows: Sequence[Mapping[str, Any]], label: str) -> str:
    """Rows of summarize.summarize_group (GroupStats), read leniently: a missing figure is n/a."""
    head = (
        f"| {label} | n | items | mean KL | 95 % CI | p50 | p90 | p95 | p99 | p99.9 | max | JSD mean | top-1 disagr. | 95 % CI |\n"
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        kl = r.get("kl_nats") or {}
        js = r.get("jsd_nats") or {}
        t1 = r.get("top1_disagreement") or {}
        lines.append(
            f"| {r.get('group', r.get('id'))} | {r.get('n', 0)} | {r.get('n_items', 0)} | {_f(kl.get('mean'))} | {_ci(kl)} | "
            f"{_f(kl.get('p50'))} | {_f(kl.get('p90'))} | {_f(kl.get('p95'))} | {_f(kl.get('p99'))} | "
            f"{_f(kl.get('p99_9'))} | {_f(kl.get('max'))} | {_f(js.get('mean'))} | {_pct(t1.get('rate'))} | "
            f"[{_pct((t1.get('ci95') or [None])[0])}, {_pct((t1.get('ci95') or [None, None])[1])}] |"
        )
    return head + "\n".join(lines) + "\n"


def render_markdown(report: Report) -> str:
    s = report["summary"]
    m = report["method"]
    b, c = report["reference"], report["candidate"]
    t1: Mapping[str, Any] = s.get("top1_disagreement") or {}
    mets = s.get("metrics", {})
    out = [
        f"# logitdiff report: drift of `{c.get('spec') or c['path']}` from `{b.get('spec') or b['path']}`\n",
        "BF16 (or whatever the reference is) is a numerical-fidelity reference, not an oracle: the "
        "figures below are *drift from the reference*, not correctness.\n",
        f"**Verdict:** {verdict_text(report)}.\n",
        f"- method: **{m['kind']}** — {m['description']}",
        f"- vocabulary: {m['vocab_size']:,}; top-K fields at K = {m['top_logprobs']}; ε = {m['epsilon']}",
        f"- positions: {s['positions']:,} over {s['paired_prompts']} items; "
        + (f"95 % CIs from {m['bootstrap']['n']} bootstrap resamples of items (seed {m['bootstrap']['seed']})"
           if m["bootstrap"]["n"] else "no 95 % CIs (--bootstrap 0): the means below carry no interval"),
    ]
    out += _interval_lines(s, m)
    rows_from = (b.get("identity") or {}).get("reference_rows")  # a served reference: generation or rescoring
    if rows_from:
        out.append(f"- reference rows: {rows_from}")
    mc = report.get("machine")
    if mc:
        simd = f" ({mc['simd']})" if mc.get("simd") else ""
        out.append(f"- compared on: {mc.get('cpu')}{simd}, {mc.get('cpu_count')} cores, {mc.get('memory_gib')} GiB, {mc.get('platform')}, Python {mc.get('python')}")
    for note in m.get("notes") or []:
        out.append(f"- note: {note}")
    out += gates_markdown(report.get("gates"))
    out.append("\n## Summary\n")
    out.append("| metric | mean | 95 % CI | p50 | p95 | p99 | max |\n|---|---:|---|---:|---:|---:|---:|")
    for key, series in SERIES.items():
        label = series.label
        d = mets.get(key)
        if d:
            out.append(
                f"| {label} | {_f(d['mean'])} | {_ci(d)} | {_f(d['p50'])} | {_f(d['p95'])} | {_f(d['p99'])} | {_f(d['max'])} |"
            )
    out.append(
        f"\n- top-1 disagreement: **{_pct(t1.get('rate'))}** ({t1.get('mismatches', s['top1_mismatches'])} of "
        f"{s['positions']} positions), 95 % CI [{_pct((t1.get('ci95') or [None])[0])}, {_pct((t1.get('ci95') or [None, None])[1])}]"
    )
    if s.get("ppl_ratio") is not None:
        out.append(f"- perplexity on the teacher tokens: reference {_f(s['ppl_ref'])}, candidate {_f(s['ppl_cand'])}, ratio {_f(s['ppl_ratio'], 6)}")
    if s.get("noise_floor"):
        nf = s["noise_floor"]
        out.append(
            f"- noise floor (reference vs its {nf.get('rerun') or 'rerun'}): mean KL {_f(nf.get('kl_nats_mean'))}; this candidate is "
            f"{_f(s.get('kl_mean_x_noise_floor'), 2)} (column {header('x_noise_floor')})"
        )
        x = s.get("kl_mean_x_noise_floor")
        if x is not None and x <= 2:
            out.append("- **warning: within 2× of the noise floor** — this drift is not distinguishable from the "
                       "reference's own run-to-run variation")
    if s.get("served_floor"):
        from ..sources.served_floor import markdown_lines

        out += markdown_lines(dict(s))
    sb = m.get("served_batching")
    if sb:
        out.append("- served batching: " + ", ".join(f"{k} `{v}`" for k, v in sb.items() if v)
                   + " (rounds: several items share the server's batches; serial: one task per batch)")
    if s.get("max_kl_source_id") is None:
        out.append("- largest KL: n/a (no positions compared)")
    else:
        out.append(
            f"- largest KL: {_f(s['kl_nats_max'])} nats at item `{s['max_kl_source_id']}` position {s.get('max_kl_position')} "
            f"(reference top token {s['max_kl_reference_top_token']!r}, candidate {s['max_kl_candidate_top_token']!r})"
        )
    out.append("\n## By output range\n")
    out.append(group_table(report["ranges"], "positions"))
    if report.get("tags"):
        out.append("\n## By tag\n")
        out.append(group_table(report["tags"], "tag"))
    if report.get("segments"):
        out.append("\n## By segment of the output\n")
        out.append("Segments come from the teacher text: `think` inside <think>…</think>, `tool_call` inside a tool-call span "
                   "(Hermes, Mistral, Llama-3 JSON), `answer` everything else.\n")
        out.append(group_table(report["segments"], "segment"))
    worst = sorted(report["items"], key=lambda r: -(kl.get("mean") or 0 if (kl := r.get("kl_nats")) else 0))[:10]
    out.append("\n## Items with the highest mean KL\n")
    out.append(group_table([{**r, "group": r["id"]} for r in worst], "item"))
    if report.get("flips"):
        out.append(flips_markdown(report["flips"]))
    if report.get("correctness"):
        out.append(correctness_markdown(report["correctness"]))
    out.append(f"\n_logitdiff {report['tool']['version']}, {report['created']}_\n")
    return "\n".join(out)


def gates_markdown(g) -> list[str]:
    """The gates section's lines: crossed (exit status 3), not evaluated (4, with the reason), or passed."""
    from .gates import CROSSED_EXIT, NOT_EVALUATED_EXIT, crossed_of, not_evaluated_of

    if not g:
        return []
    out = []
    crossed, missing = crossed_of(g), not_evaluated_of(g)
    if crossed:
        out.append(f"- **gates crossed: {', '.join(crossed)}** (exit status {CROSSED_EXIT})")
    if missing:
        out.append(f"- **gates not evaluated: {', '.join(missing)}**" + ("" if crossed else f" (exit status {NOT_EVALUATED_EXIT})"))
        for x in g["gates"]:
            if x["gate"] in missing:
                out.append(f"  - `{x['gate']}`: {x.get('reason') or 'the report has no ' + repr(x['metric'])}; not counted as crossed")
    if not crossed and not missing:
        out.append(f"- gates: all {len(g['gates'])} passed ({', '.join(x['gate'] for x in g['gates'])})")
    return out


def _one_line(text: str, n: int = 80) -> str:
    t = text.replace("\n", "⏎").replace("|", "\\|")
    return t if len(t) <= n else t[: n - 1] + "…"


def _outcome_table(groups: dict, label: str) -> str:
    """One row per group; a column per outcome that occurs in some group (the others are 0 everywhere)."""
    shown = Outcome.occurring(*groups.values())
    lines = [f"| {label} | branches | " + " | ".join(shown) + " |", "|---|---:|" + "---:|" * len(shown)]
    for g, d in groups.items():
        lines.append(f"| {g} | {d['n']} | " + " | ".join(f"{d.get(o, 0)} ({_pct(d['rates'].get(o))})" for o in shown) + " |")
    return "\n".join(lines) + "\n"


def _meaning_line(f: Flips) -> str:
    """Who judged meaning: a named judge, the classifier before report 2.1 (an older report), or nobody."""
    judge = f.get("meaning_judged_by")
    if not judge:
        return ("- meaning: not judged (no --judge). A branch that did not come back on an item without a checker is "
                "`diverged`: what was observed (where it left, salient differences, similarity) is in its decided_by")
    return f"- meaning (benign / meaning_changed of diverged branches): judged by {judge}"


def judge_line(j: dict) -> str:
    """The report's line naming the judge of ``--judge`` (report.json ``flips.judge``)."""
    m = j.get("model") or {}
    v = j.get("verdicts") or {}
    return (f"- judge of the diverged branches: `{j.get('spec')}` ({m.get('model')}, {m.get('sha256') or 'no sha256'}), "
            f"{j.get('n_judged')} judged: {v.get('same')} same (benign), {v.get('different')} different (meaning_changed), "
            f"{v.get('unparsed')} unparsed (left diverged); prompt and parse rule: docs/flips.md, Judges; "
            f"{j.get('agreement_text')}")


def flips_markdown(f: Flips) -> str:
    out = ["\n## What the flips do\n"]
    st = f.get("settings") or {}
    out.append(
        f"- {f['n_flips']} top-1 flips ({_pct(f.get('flip_rate'))} of positions); {f['selection']}; "
        f"{f['n_branches']} branches continued greedily by the candidate"
    )
    if f.get("n_ties"):
        out.append(f"- {f['n_ties']} ties at the reference (margin within rounding of 0: {f['ties']['tolerance']}): "
                   "the engines break the tie, the candidate did not flip; not counted as flips or outcomes")
    sc = f.get("reference_self_consistency")
    if sc and sc.get("n_written_not_top1"):
        out.append(f"- reference self-consistency: at {sc['n_written_not_top1']} of {sc['n_positions']} positions the token the "
                   f"reference wrote is not its own scored top-1 (generation and scoring in other batch shapes); at "
                   f"{sc['n_candidate_wrote_it']} of them the candidate picked the written token: not flips, not branched")
    lo = f.get("left_out")
    if lo and lo.get("n"):
        out.append(f"- left out by --max-branches: {lo['n']} selected flips in {lo['n_items']} items, not branched: "
                   + ", ".join(f"{x['item_id']}@{x['position']}" for x in lo["list"][:20]) + (" ..." if lo["n"] > 20 else ""))
    ch = f.get("changed_items")
    if ch:
        out.append(f"- items whose answer or tool call changed: {len(ch)}; "
                   + "; ".join(f"{x['item_id']} ({x['change']}): " + (f"branched at {x['position']}, {x['outcome']}" if x["branched"]
                                                                    else f"not branched, {x['why_not']}") for x in ch[:20]))
    cut = f.get("outputs_cut")
    if cut and (cut.get("reference_cut") or cut.get("branches_cut")):
        out.append(f"- cut by the token budget: {cut['reference_cut']} of {cut['n_items']} reference outputs, "
                   f"{cut['branches_cut']} of {cut['n_branches']} branches")
    if f.get("judge"):
        out.append(judge_line(f["judge"]))
    thr = st.get("similarity_thresholds")
    out.append(f"- similarity (an observation, not a decision): {f['similarity']}" + ("" if "threshold" in f["similarity"] else f" (threshold {thr})"))
    if "max_shift" in st:
        out.append(f"- recovered = re-joined the reference ({st['resync_tokens']} common tokens at most {st['max_shift']} "
                   f"tokens out of line) and stayed joined (detours of at most {st['max_detour']} tokens) to the end, "
                   f"and the item's checker, where it has one, gives the same verdict; "
                   f"{f.get('recovered_ending_dissimilar', 0)} recovered branches end dissimilar to the reference "
                   "(last third, difflib ratio < 0.5)")
    else:
        out.append(f"- re-join = {st.get('resync_tokens')} common tokens")
    out.append(_meaning_line(f))
    if f["n_branches"]:
        out.append("\n| outcome | branches | rate |\n|---|---:|---:|")
        for o in (o for o in Outcome.ALL if o in f["outcomes"]):
            out.append(f"| {o} | {f['outcomes'][o]} | {_pct(f['rates'].get(o))} |")
        out.append("\n### By tag\n")
        out.append(_outcome_table(f["by_tag"], "tag"))
        out.append("\n### By output range\n")
        out.append(_outcome_table(f["by_range"], "positions"))
        out.append("\n### By reference margin p(top1) − p(top2)\n")
        out.append(_outcome_table(f["by_margin"], "margin"))
    if f.get("both"):
        b = f["both"]
        out.append(
            f"\n- reference continuing from the candidate's token: token was poison in {b['token_was_poison']} "
            f"branches, the candidate drifts anyway in {b['candidate_drifts_anyway']}"
        )
    if f.get("top"):
        out.append("\n### Most consequential flips, and examples of every outcome\n")
        out.append("| item | pos | outcome | KL | margin | reference → candidate token | re-join / left at | reference continues | candidate continues |")
        out.append("|---|---:|---|---:|---:|---|---|---|---|")
        for r in f["top"]:
            if "rejoin_position" not in r:
                at = "n/a"
            elif r["rejoin_position"] is None:
                at = "no re-join"
            else:
                at = f"{r['rejoin_position']} / " + ("stayed" if r.get("left_position") is None else str(r["left_position"]))
            out.append(
                f"| {r['item_id']} | {r['position']} | {r['outcome']} | {_f(r['kl_nats'])} | {_f(r['margin_ref'])} | "
                f"{_one_line(repr(r['ref_token']), 20)} → {_one_line(repr(r['cand_token']), 20)} | {at} | "
                f"{_one_line(r['ref_continuation'])} | {_one_line(r['branch_continuation'])} |"
            )
    return "\n".join(out) + "\n"


def correctness_markdown(c: Correctness) -> str:
    ci = lambda x: f"[{_pct(x[0])}, {_pct(x[1])}]" if x and x[0] is not None else "n/a"  # noqa: E731
    out = ["\n## Correctness of free-running answers\n"]
    out.append(
        f"- {c['n_labelled']} labelled items, {c.get('measure') or 'accuracy'}"
        + (f" ({c['benchmark']}, graded by its own tests or checker)" if c.get("benchmark") else "")
        + f": reference {_pct(c['accuracy_ref'])} {ci(c['accuracy_ref_ci'])}, "
        f"candidate {_pct(c['accuracy_cand'])} {ci(c['accuracy_cand_ci'])}; difference {_pct(c['accuracy_diff'])} "
        f"{ci(c['accuracy_diff_ci'])}"
    )
    out.append(
        f"- correctness flips: **{c['right_to_wrong']} right→wrong**, "
        + (f"**{c['right_to_truncated']} right→truncated**, " if c.get("right_to_truncated") else "")
        + f"**{c['wrong_to_right']} wrong→right** "
        f"(McNemar exact p = {_f(c['mcnemar_p'], 3)}); {c['flips_starting_at_top1_flip']} of {c['correctness_flips']} "
        f"start at a teacher-forced top-1 flip"
    )
    for d in (c.get("prompt_forms") or {}).values():
        out.append(f"- HumanEval prompt form ({d['n']} items): {d['means']}")
    for form, d in (c.get("tool_forms") or {}).items():
        out.append(f"- functions shown to the model ({d['n']} benchmark items): {d['means']}")
    if c.get("n_tool_items"):
        out.append(
            f"- schema-valid tool calls on {c['n_tool_items']} tool items: reference {_pct(c['tool_call_valid_ref'])}, "
            f"candidate {_pct(c['tool_call_valid_cand'])}"
        )
    if c.get("cut_ref") or c.get("cut_cand"):
        out.append(f"- cut by the token budget ({c.get('budget_tokens') or 'per item'} tokens): {c['cut_ref']} reference and "
                   f"{c['cut_cand']} candidate outputs; graded truncated (cut, and not right; not counted as wrong): "
                   f"{c['truncated_ref']} reference, {c['truncated_cand']} candidate; {c['right_to_truncated']} right→truncated")
    if c.get("items_right_to_wrong"):
        out.append(f"- right→wrong items: {', '.join(c['items_right_to_wrong'][:20])}")
    out.append("\n| tag | n | reference | candidate | right→wrong | wrong→right |\n|---|---:|---:|---:|---:|---:|")
    for t, d in c["by_tag"].items():
        out.append(f"| {t} | {d['n']} | {_pct(d['accuracy_ref'])} | {_pct(d['accuracy_cand'])} | {d['right_to_wrong']} | {d['wrong_to_right']} |")
    return "\n".join(out) + "\n" + attribution_markdown(c)


def attribution_markdown(c: Mapping[str, Any]) -> str:
    """report.md's table of correctness.attribution (schema 2.1): each changed answer, the first
    teacher-forced top-1 flip on its item and the branch taken there, or why there is none."""
    records = c.get("attribution") or []
    if not records:
        return ""
    out = [f"\n### Changed answers, attributed\n\n{attributed_text(c.get('attributed')) or ''}.\n",
           "| item | direction | first flip: position | reference → candidate token | p ref / p cand | margin | KL "
           "| outputs part at it | branch |", "|---|---|---:|---|---|---:|---:|---|---|"]
    for r in records:
        f, b = r.get("first_flip"), r.get("branch")
        if f:
            flip = (f"{f['position']} | {_one_line(repr(f['ref_token']), 20)} → {_one_line(repr(f['cand_token']), 20)} | "
                    f"{_f(f['p_ref'], 3)} / {_f(f['p_cand'], 3)} | {_f(f['margin_ref'], 3)} | {_f(f['kl_nats'], 3)}")
        else:
            flip = f"— | {r.get('no_flip') or 'no teacher-forced flip on this item'} | | | "
        part = {True: "yes", False: f"no (at {r.get('first_divergence')})", None: "n/a"}[r.get("divergence_at_first_flip")]
        branch = (f"{b['outcome']} at {b['position']}" + ("" if b.get("at_first_flip") else " (another flip of the item)")
                  + (f", {b['decided_by']}" if b.get("decided_by") else "")) if b else ""
        if r.get("not_branched"):
            branch += ("; " if branch else "") + f"first flip not branched: {r['not_branched']}"
        out.append(f"| {r['item_id']} | {AnswerChange.ARROW.get(r['direction'], r['direction'])} | {flip} | {part} | {branch} |")
    return "\n".join(out) + "\n"


def _interval_lines(s: Mapping[str, Any], m: Mapping[str, Any]) -> list[str]:
    """One line per approximated divergence: the proven lower bound first (the end a real
    model's tail leaves informative), the estimate, then the upper bound, flagged when the
    interval is wider than the estimate (``NAME_upper_uninformative``)."""
    out = []
    for name, label in (("kl", "mean KL"), ("kl_rev", "mean reverse KL"), ("jsd", "mean JSD")):
        lo, hi = s.get(f"{name}_lower_nats_mean"), s.get(f"{name}_upper_nats_mean")
        if lo is None and f"{name}_lower_nats_mean" not in s:
            continue
        est = ((s.get("metrics") or {}).get(f"{name}_nats") or {}).get("mean")
        up = "inf (no finite upper bound, see method)" if hi is None else f"{hi:.4g}"
        low = "n/a" if lo is None else f"{lo:.4g}"
        figure = "no estimate from this method" if est is None else f"estimate {est:.4g} nats"
        line = f"- {label}: at least {low} nats (proven lower bound), {figure}, upper bound {up}"
        if s.get(f"{name}_upper_uninformative"):
            width = s.get(f"{name}_interval_width_mean")
            pct = f"{100 * width / est:,.0f} % of" if (width is not None and est) else "wider than"
            line += f" — uninformative: the interval's width is {pct} the estimate (read this figure from below)"
        out.append(line + f" — method **{m.get('bounds')}** (docs/bounds.md)")
    return out
