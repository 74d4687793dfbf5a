"""How far a judge agrees with blind readers: ``logitdiff judge agreement --judge SOURCE``.

The labelled sets are the repository's ``tests/data/flip_labels_{smollm,smollm_b,real}.jsonl``
(branches of real runs, labelled blind by a reader: docs/flips.md), with a second reader's
labels in ``*_reader2.jsonl`` where one exists. Every case labelled ``benign`` or
``recovered`` is *same* (the branch says what the reference says), ``meaning_changed`` is
*different*; the judge sees the case's text before the flip and both continuations through
:func:`logitdiff.flips.judge.Judge.answers` (the prompt and parse rule of ``--judge``).

Per class: how many cases the judge answers as the reader did, with a Wilson 95 % interval;
Cohen's kappa over all cases (an unparsed answer is a third category, never agreeing); the
same against the two readers' consensus (cases both readers put in the same class) where a
second reader exists.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..contracts import JudgeVerdict, Outcome
from ..errors import LogitdiffError
from .grading import wilson_ci
from .judge import Judge, parse_answer

SETS = ("smollm", "smollm_b", "real")
# a reader's label -> the judge's class it should answer
CLASS_OF_LABEL = {Outcome.BENIGN: JudgeVerdict.SAME, Outcome.RECOVERED: JudgeVerdict.SAME,
                  Outcome.MEANING_CHANGED: JudgeVerdict.DIFFERENT}
CLASSES = (JudgeVerdict.SAME, JudgeVerdict.DIFFERENT)


def default_labels_dir() -> Path:
    """Where a checkout keeps the labelled sets: ``tests/data`` beside ``src/`` (absent from an
    installed wheel, which does not ship them)."""
    return Path(__file__).resolve().parents[3] / "tests" / "data"


@dataclass
class Case:
    id: str
    context: str
    reference: str
    branch: str
    reader: str  # JudgeVerdict.SAME / DIFFERENT of the first reader
    reader2: str | None  # of the second reader, None where there is none


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise LogitdiffError(f"{path}: line {n}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise LogitdiffError(f"{path}: line {n}: not a JSON object")
            out.append(d)
    return out


def load_set(name: str, labels_dir: Path) -> list[Case]:
    """The cases of one labelled set whose first reader said benign, recovered or
    meaning_changed, with the second reader's class where one labelled them."""
    path = labels_dir / f"flip_labels_{name}.jsonl"
    if not path.is_file():
        raise LogitdiffError(f"{path}: not found (the labelled sets live in the logitdiff repository's tests/data, not in "
                             "the installed package; run from a checkout or pass --labels DIR)")
    second = labels_dir / f"flip_labels_{name}_reader2.jsonl"
    reader2 = {d.get("id"): d.get("label") for d in _read_jsonl(second)} if second.is_file() else {}
    cases = []
    for n, d in enumerate(_read_jsonl(path), 1):
        if d.get("label") not in CLASS_OF_LABEL:
            continue
        for key in ("id", "prefix", "ref", "branch"):
            if not isinstance(d.get(key), str):
                raise LogitdiffError(f"{path}: line {n}: item {d.get('id')!r}: field {key!r} is not a string")
        r2 = reader2.get(d["id"])
        cases.append(Case(d["id"], d["prefix"], d["ref"], d["branch"], CLASS_OF_LABEL[d["label"]],
                          CLASS_OF_LABEL.get(r2) if r2 is not None else None))
    return cases


def spread(cases: Sequence[Case], limit: int | None) -> list[Case]:
    """``limit`` cases spread evenly through the set (the k-th of every len/limit), all when
    ``limit`` is None or not smaller: the files are ordered by candidate and item."""
    if limit is None or limit >= len(cases):
        return list(cases)
    return [cases[(k * len(cases)) // limit] for k in range(limit)]


def cohen_kappa(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Cohen's kappa of two labelings of the same cases: (p_o - p_e) / (1 - p_e), p_e from each
    side's own class shares; None when chance agreement is 1 (one class on both sides)."""
    n = len(a)
    if n == 0 or n != len(b):
        return None
    p_o = sum(x == y for x, y in zip(a, b)) / n
    p_e = sum((a.count(c) / n) * (b.count(c) / n) for c in set(a) | set(b))
    return None if p_e >= 1 else (p_o - p_e) / (1 - p_e)


def agreement(truth: Sequence[str], got: Sequence[str]) -> dict[str, Any]:
    """Per class (agreeing, cases, Wilson 95 % interval), unparsed answers and kappa."""
    per = {}
    for c in CLASSES:
        idx = [k for k, t in enumerate(truth) if t == c]
        ok = sum(got[k] == c for k in idx)
        per[c] = {"agree": ok, "n": len(idx), "ci": wilson_ci(ok, len(idx))}
    return {"n": len(truth), "per_class": per, "unparsed": sum(g == JudgeVerdict.UNPARSED for g in got),
            "kappa": cohen_kappa(list(truth), list(got))}


def measure(judge: Judge, cases: Sequence[Case], progress=None, batch: int = 8) -> dict[str, Any]:
    """The judge's answer to every case, and its agreement with the first reader and (where
    there is a second) with the readers' consensus."""
    t0 = time.time()
    raw: list[str] = []
    for a in range(0, len(cases), batch):
        part = cases[a:a + batch]
        raw += judge.answers([(c.context, c.reference, c.branch) for c in part])
        if progress:
            progress(len(part))
    got = [parse_answer(t) for t in raw]
    out: dict[str, Any] = {"seconds": time.time() - t0, "reader": agreement([c.reader for c in cases], got),
                           "answers": [{"id": c.id, "reader": c.reader, "verdict": g, "raw": t} for c, g, t in zip(cases, got, raw)]}
    both = [k for k, c in enumerate(cases) if c.reader2 is not None and c.reader2 == c.reader]
    if any(c.reader2 is not None for c in cases):
        out["consensus"] = agreement([cases[k].reader for k in both], [got[k] for k in both])
    return out
