"""What a branch says that the reference does not: numbers, names, literals, claims.

Similarity scores (edit similarity, MiniLM) average over a whole text: one changed name,
number or negation in otherwise equal text barely moves them. These checks look at the
*salient* parts of both continuations, on both full sides, and say which changed:

* numbers, everywhere;
* on code: identifiers (names, keywords), string literals and the text of ``def`` lines
  (a signature), outside comments and docstrings;
* on prose: negations (``not``, ``no``, ``never``, ``n't``...), names (capitalised words
  not at a sentence start, words with digits such as ``3.5``/``v2``) and content words
  (not stop words; a share of them on one side only).

Both sides are compared as sequences (:class:`difflib.SequenceMatcher`), with two
tolerances that keep budget and shift effects out:

* *the cut tail*: a text cut by the token budget may end inside a token (its last one is
  dropped) and stops where the other may go on, so what the other side has after the cut
  side's end is not a change;
* *a pure shift*: the branch skips whole lines of the reference right after the flip and
  then writes the reference's text (an omission at the start, across a line break): the
  skipped lines are not a change of what is written. Anything else missing, added or
  replaced is.
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher
from typing import Callable, NamedTuple

import numpy as np

_NUMBER = re.compile(r"(?<![A-Za-z_\d.])[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# short string literals (one line); triple-quoted strings are docstrings: prose, left out
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_COMMENT = re.compile(r"#[^\n]*")
_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*[A-Za-z]|[A-Za-z]")
_CLITIC = re.compile(r"['’](s|re|ll|ve|d|m)$", re.I)
NEGATIONS = frozenset("not no never none nothing nobody neither nor cannot without".split())
STOP = frozenset("""
a an the and or but if then else of to in on at by for with from into onto over under as is are was were be been being
this that these those it its it's they them their there here he she his her we our you your i me my mine which who whom
whose what when where why how all any some each every both either more most less least much many few one ones also
so such than too very can could may might must shall should will would do does did done has have had having
not no never only just even still yet again ever about above after before between through during while until
up down out off own same other another s t d ll re ve m y etc e g i.e e.g via per use used using uses
rather quite fairly pretty somewhat really upon within without across among along against toward towards beside
behind beyond near around
""".split())
# A prose branch whose content words on one side only make up more than this share of
# both sides' content words says something else (a paraphrase swaps a word or two).
CONTENT_CHANGED_SHARE = 0.6
# MiniLM cosine of two single words at or above which one stands for the other (a synonym
# or an inflection: "method"/"way", "canonical"/"standard"); unrelated words lie lower.
WORD_MATCH = 0.5
# Word salad (is_word_salad): at least this many content words, each used twice or more on
# average. The bundled model's prose is such text; a person's prose repeats few words.
SALAD_MIN_WORDS = 6
SALAD_DISTINCT_SHARE = 0.5


class Tok(NamedTuple):
    kind: str  # number | ident | string | sig | neg | name | word
    text: str
    start: int  # character offset in its text
    end: int


def _mask(text: str, pattern: re.Pattern) -> str:
    """The text with each match blanked out (offsets unchanged)."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _num(s: str) -> str:
    s = s.replace(",", "")
    try:
        return repr(float(s))
    except ValueError:
        return s


def _docstrings(text: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Triple-quoted strings (docstrings: prose, not code) as (start, end) spans of their
    quotes and content, and the stray quotes. A fragment cut out of a longer text may hold
    an odd number of triple quotes (a run of empty ``\"\"\"`` lines with one line skipped,
    or a docstring opened in the prompt), so quotes are paired in order, and a "string"
    whose lines look like code is taken as a stray quote and the pairing goes on from its
    closing quote; a quote left unclosed at the end is a stray quote too."""
    marks = [m.start() for m in re.finditer(r'"""|\'\'\'', text)]
    spans: list[tuple[int, int]] = []
    stray: list[int] = []
    k = 0
    while k < len(marks):
        a = marks[k]
        if k + 1 < len(marks):
            b = marks[k + 1]
            inner = text[a + 3 : b]
            if not any(_CODE_LINE.search(x) for x in inner.splitlines() if x.strip()):
                spans.append((a, b + 3))
                k += 2
                continue
        stray.append(a)
        k += 1
    return spans, stray


def _mask_docstrings(text: str) -> str:
    """Blank out triple-quoted strings and stray triple quotes (:func:`_docstrings`)."""
    spans, stray = _docstrings(text)
    out = list(text)
    for a, b in spans:
        for i in range(a, b):
            if out[i] != "\n":
                out[i] = " "
    for a in stray:
        out[a : a + 3] = "   "
    return "".join(out)


# A line of code starts with a statement keyword or is mostly not plain words; a line of
# prose (markdown around code, a docstring line, an answer in words) is mostly plain words.
_STATEMENT = re.compile(r"^\s*(pass|break|continue|return|yield|raise|import|del|global|nonlocal|assert|lambda|await|"
                        r"with|while|class|def|print|async)\b")
_PLAIN_WORD = re.compile(r"^[(*_]*[A-Za-z][A-Za-z'’-]*[)*_.,;:!?]*$")
PROSE_LINE_WORDS = 0.6


def _is_prose_line(line: str) -> bool:
    """Most of the line's whitespace-separated pieces are plain words, and it is not a
    statement (``return x``, ``pass``) or a line that looks like Python."""
    bare = re.sub(r"`[^`\n]*`", " code ", line)  # inline code in prose is one piece of it
    if (_CODE_LINE.search(line) or _STATEMENT.search(line) or re.search(r"(?<![=!<>])=(?!=)|\w\(|[%{}\[\]]", bare)):
        return False
    pieces = bare.split()
    return bool(pieces) and sum(bool(_PLAIN_WORD.match(x)) for x in pieces) >= PROSE_LINE_WORDS * len(pieces)


def split_prose(text: str) -> tuple[str, str]:
    """(code, prose): the text twice, each with the other's characters blanked (offsets and
    line breaks kept). In an output about code, the words around the code are prose and are
    judged as prose (the labelling rules judge what a reader takes from them): docstrings,
    and lines of plain words outside markdown code fences (an explanation after the code, an
    answer in words, a docstring line whose quotes lie in the prompt). Fence lines, ``#``
    comment lines (comment wording is not a change of the code) and triple quotes are in
    neither; comments after code on its line are left out by :func:`code_tokens`."""
    n = len(text)
    kind = bytearray(n)  # 0 code, 1 prose, 2 neither
    spans, stray = _docstrings(text)
    for a, b in spans:
        kind[a : a + 3] = b"\x02\x02\x02"
        kind[b - 3 : b] = b"\x02\x02\x02"
        for i in range(a + 3, b - 3):
            kind[i] = 1
    for a in stray:
        kind[a : a + 3] = b"\x02\x02\x02"
    pos = 0
    for line in text.split("\n"):
        a, b = pos, pos + len(line)
        pos = b + 1
        if line.strip().startswith("```") or line.lstrip().startswith("#"):
            # a fence, or a comment line (comment wording is no change of the code): neither
            kind[a:b] = b"\x02" * (b - a)
            continue
        if any(kind[i] == 1 for i in range(a, b)):
            continue  # a docstring line
        # (whether a line lies inside a fence is not trusted: the fence may have opened in
        # the prompt; code inside a fence does not read as plain words anyway)
        if _is_prose_line(line.replace('"""', "   ")):
            for i in range(a, b):
                if kind[i] == 0:
                    kind[i] = 1
    code = "".join(c if k == 0 or c == "\n" else " " for c, k in zip(text, kind))
    prose = "".join(c if k == 1 or c == "\n" else " " for c, k in zip(text, kind))
    return code, prose


def code_tokens(text: str) -> list[Tok]:
    """Numbers, identifiers, short string literals and ``def`` lines of code, in order."""
    text = _mask_docstrings(text)
    out: list[Tok] = []
    strings = list(_STRING.finditer(text))
    bare = _mask(text, _STRING)
    bare = _mask(bare, _COMMENT)
    for m in strings:
        if not _COMMENT.search(text[max(0, text.rfind("\n", 0, m.start())) : m.start()]):
            out.append(Tok("string", repr(m.group(0)[1:-1]), m.start(), m.end()))  # the content, not the quote style
    for m in _NUMBER.finditer(bare):
        out.append(Tok("number", _num(m.group(0)), m.start(), m.end()))
    for m in _IDENT.finditer(bare):
        out.append(Tok("ident", m.group(0), m.start(), m.end()))
    for m in re.finditer(r"^[ \t]*(?:async\s+)?def\s+[^\n]*\)[^\n]*:", bare, re.M):
        out.append(Tok("sig", " ".join(m.group(0).split()), m.start(), m.end()))
    return sorted(out, key=lambda t: (t.start, t.kind))


def _stem(w: str) -> str:
    """A crude stem: the inflections of one word share it (``squared``/``square``,
    ``reverses``/``reverse``, ``tuples``/``tuple``): a suffix off, then a final ``e``."""
    w = w.lower().replace("’", "'")
    for suf in ("'s", "ies", "es", "s", "ing", "ed", "ly"):
        if w.endswith(suf) and len(w) - len(suf) >= 3:
            w = w[: -len(suf)]
            break
    return w[:-1] if w.endswith("e") and len(w) > 3 else w


def prose_tokens(text: str) -> list[Tok]:
    """Numbers, negations, names and content words of prose, in order."""
    out: list[Tok] = [Tok("number", _num(m.group(0)), m.start(), m.end()) for m in _NUMBER.finditer(text)]
    for m in _WORD.finditer(text):
        w = _CLITIC.sub("", m.group(0))  # what's, Earth's: what, Earth
        low = w.lower().replace("’", "'")
        if low in NEGATIONS or low.endswith("n't"):
            out.append(Tok("neg", "not", m.start(), m.end()))
            continue
        # the last non-blank character before the word (a walk back over the blanks, not a
        # slice of everything before it: that made long texts quadratic);
        # a quote or bracket does not start a sentence: "None", (Python) are names
        k = m.start() - 1
        while k >= 0 and text[k].isspace():
            k -= 1
        sentence_start = k < 0 or text[k] in ".!?:\n*-#>"
        pronoun = low == "i" or low.startswith(("i'", "i’"))  # I, I'm, I'll: not names
        if pronoun:
            continue
        if w[0].isupper() and not sentence_start and low not in STOP:
            out.append(Tok("name", w, m.start(), m.end()))
        elif low not in STOP and len(low) >= 3:
            out.append(Tok("word", _stem(low), m.start(), m.end()))
    named = set()
    for m in re.finditer(r"\b[A-Za-z]+\d[\w.]*|\b\w+_\w+|\b[A-Za-z_]\w+(?:\.[A-Za-z_]\w*)+", text):
        # v2, py3, snake_case and dotted names (numpy.corrcoef, archives.py) in prose
        out.append(Tok("name", m.group(0).rstrip("."), m.start(), m.end()))
        named.add(m.start())
    names_at = {t.start for t in out if t.kind == "name"}  # looked up per identifier: a set, not a scan
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        # inline code in prose: its identifiers are names (`covariance`, `x`)
        for n in _IDENT.finditer(m.group(1)):
            a = m.start(1) + n.start()
            if a not in named and a not in names_at:
                out.append(Tok("name", n.group(0), a, a + len(n.group(0))))
                names_at.add(a)
    return sorted(out, key=lambda t: (t.start, t.kind))


def _drop_cut_end(toks: list[Tok], text: str, cut: bool) -> tuple[list[Tok], int]:
    """A text cut by the budget may end inside its last token: leave that token out. Also
    returns where the compared text ends (the start of a token left out)."""
    if cut and toks and toks[-1].end >= len(text.rstrip()):
        return toks[:-1], toks[-1].start
    return toks, len(text)


def compare(ref: str, branch: str, *, code: bool, ref_cut: bool = False, branch_cut: bool = False,
            kinds: tuple[str, ...] | None = None, start: int = 0,
            word_similarity: Callable[[list[str], list[str]], np.ndarray] | None = None) -> dict:
    """Salient differences between the reference's and the branch's continuation.

    Returns ``{"changed": [...], "shifted": bool, "content_share": float | None}``:
    ``changed`` holds one line per change (``number 3.0 -> 5.0``, ``added ident foo``,
    ``negation added``...), ``shifted`` says a pure shift was tolerated, and
    ``content_share`` (prose) the share of content words on one side only that no word
    on the other side stands for. ``start``: the character offset where the texts first
    differ (their shared prefix); ``word_similarity(words_a, words_b)``: a cosine matrix
    of words (MiniLM): a word on one side only that is this similar (>= ``WORD_MATCH``) to
    a word on the other side only is a synonym, not new content. Without it every such
    word counts (stricter).
    """
    # whole texts are tokenized (a comment or docstring opened before the flip is still one),
    # then only what lies from ``start`` (where the two first differ) on is compared. In an
    # output about code, the code is compared as code and the words around it as prose.
    # Each side's prose is tokenized once, here; content_words and is_word_salad take these tokens.
    ref_code_at: set[int] = set()  # where the reference's code tokens start
    if code:
        (ref_code, ref_prose), (br_code, br_prose) = split_prose(ref), split_prose(branch)
        prose_a, prose_b = prose_tokens(ref_prose), prose_tokens(br_prose)
        code_a = code_tokens(ref_code)
        ref_code_at = {t.start for t in code_a}
        tok_a = sorted(code_a + prose_a, key=lambda t: (t.start, t.kind))
        tok_b = sorted(code_tokens(br_code) + prose_b, key=lambda t: (t.start, t.kind))
    else:
        ref_prose, br_prose = ref, branch
        ref_code = br_code = ""
        tok_a, tok_b = prose_tokens(ref), prose_tokens(branch)
        prose_a, prose_b = tok_a, tok_b
    a, a_len = _drop_cut_end(tok_a, ref, ref_cut)
    b, b_len = _drop_cut_end(tok_b, branch, branch_cut)
    a = [t for t in a if t.end > start]
    b = [t for t in b if t.end > start]
    if kinds is not None:
        a = [t for t in a if t.kind in kinds]
        b = [t for t in b if t.kind in kinds]
    strict = ("number", "ident", "string", "sig", "neg", "name")
    sa = [(t.kind, t.text) for t in a if t.kind in strict]
    sb = [(t.kind, t.text) for t in b if t.kind in strict]
    ta = [t for t in a if t.kind in strict]
    tb = [t for t in b if t.kind in strict]
    changed: list[str] = []
    shifted = False
    code_a_or_b = code and (bool(ref_code_at) or bool(ref_code.strip()) or bool(br_code.strip()))
    char_lim = _char_limits(ref, branch, start, a_len, b_len)
    ops = SequenceMatcher(None, sa, sb, autojunk=False).get_opcodes()
    for k, (op, i1, i2, j1, j2) in enumerate(ops):
        if op == "equal":
            continue
        # a pure shift: right after the flip the branch skips whole lines of the reference
        if op == "delete" and i1 == 0 and k == 0 and len(ops) > 1 and "\n" in ref[ta[i1].start : ta[i2 - 1].end + 1 if i2 < len(ta) else len(ref)]:
            if _rest_equal(ops[1:], sa, sb, ref_cut, branch_cut):
                shifted = True
                continue
        # the cut tail: past the end of a side the budget cut, the other side goes on
        lim_a, lim_b = _limits(ops[:k], ta, tb, a_len, b_len, start)
        if not code_a_or_b:
            # prose: the ends aligned by characters, as for content words (names, numbers and
            # negations are too sparse to align two texts by)
            lim_a, lim_b = char_lim
        # (past the branch's end the reference's items are not judged where the budget cut
        # the branch, or where it stopped and the items are words, not code: stopping earlier
        # is benign, code that stops short is other code; past the reference's end the
        # branch's are judged unless the budget cut the reference: going on must repeat)
        gone = [sa[i] for i in range(i1, i2)
                if not (ta[i].start >= lim_a and (branch_cut or ta[i].start not in ref_code_at))]
        new = [sb[j] for j in range(j1, j2) if not (ref_cut and tb[j].start >= lim_b)]
        if gone or new:
            changed.append(_describe("insert" if not gone else "delete" if not new else "replace", gone, new))
    share = None
    salad = False
    local = True
    if not code or ref_prose.strip() or br_prose.strip():
        words = content_words(ref_prose, br_prose, a, b, ref_cut=ref_cut, branch_cut=branch_cut, a_len=a_len, b_len=b_len,
                              start=start, word_similarity=word_similarity, ref_full=ref, branch_full=branch,
                              prose=(prose_a, prose_b), char_limits=char_lim)
        ua, ub, n_union = words["only_ref"], words["only_branch"], words["n_union"]
        if n_union:
            share = (len(ua) + len(ub)) / n_union
        salad = is_word_salad(ref_prose, prose_a)
        if salad:
            # word salad asserts by which content words it uses: one on one side only is
            # another claim; the same words in another order say the same (at most benign)
            local = not words["reordered"]
            if ua or ub:
                changed.append(f"content words on one side only ({', '.join(ua[:3]) or '-'} / {', '.join(ub[:3]) or '-'})")
        elif share is not None and share > CONTENT_CHANGED_SHARE and min(words["n_ref"], words["n_branch"]) >= 3:
            changed.append(f"content words on one side only: {100 * share:.0f} % ({', '.join(ua[:3])} / {', '.join(ub[:3])})")
    return {"changed": changed, "shifted": shifted, "content_share": share, "word_salad": salad, "local": local}


def is_word_salad(text: str, tokens: list[Tok] | None = None) -> bool:
    """Text that says the same few content words again and again (``If the exception is
    raised if the exception is raised``): at least ``SALAD_MIN_WORDS`` content words (and
    names), each used ``1 / SALAD_DISTINCT_SHARE`` times or more on average. Such text
    carries its claims by which words it uses, not by its wording. ``tokens``: the text's
    :func:`prose_tokens`, when the caller has them."""
    w = [t.text for t in (prose_tokens(text) if tokens is None else tokens) if t.kind in ("word", "name")]
    return len(w) >= SALAD_MIN_WORDS and len(set(w)) <= SALAD_DISTINCT_SHARE * len(w)


def content_words(ref: str, branch: str, a: list[Tok], b: list[Tok], *, ref_cut: bool, branch_cut: bool, a_len: int,
                  b_len: int, start: int, word_similarity=None, ref_full: str | None = None,
                  branch_full: str | None = None, prose: tuple[list[Tok], list[Tok]] | None = None,
                  char_limits: tuple[float, float] | None = None) -> dict:
    """Content words of prose on one side only, both full sides from ``start`` compared as
    sets (``a``/``b``: the tokens :func:`compare` compares), with its tolerances: past the
    end of a side the budget cut, the other side's words are not judged (the ends aligned by
    characters, :func:`_char_limits`); a cut side's last word may be cut inside (it matches
    any word it begins or that begins it); past the end of a side that *stopped*, the other
    side's words that repeat what was said before them are not new. A word with MiniLM
    cosine >= ``WORD_MATCH`` to a word on the other side only is a synonym, not new.
    ``reordered``: the words as sequences differ beyond such synonyms (a reworded or
    reordered text, not a local change). ``prose``: the :func:`prose_tokens` of ``ref`` and
    ``branch``, when the caller has them (:func:`compare` does), and ``char_limits`` its
    :func:`_char_limits` of the full texts."""
    wa = [t for t in a if t.kind == "word"]
    wb = [t for t in b if t.kind == "word"]
    toks_a, toks_b = prose if prose is not None else (prose_tokens(ref), prose_tokens(branch))
    all_a = [t for t in toks_a if t.kind == "word"]
    all_b = [t for t in toks_b if t.kind == "word"]
    # a cut side's last word (left out by _drop_cut_end) comes back as a possibly cut word
    pa, pb = _partial_last(all_a, ref, ref_cut, start), _partial_last(all_b, branch, branch_cut, start)
    lim_a, lim_b = char_limits or _char_limits(ref if ref_full is None else ref_full,
                                               branch if branch_full is None else branch_full, start, a_len, b_len)
    A, B = {t.text for t in wa}, {t.text for t in wb}

    def begins(x: str, y: str) -> bool:
        return x.startswith(y) or y.startswith(x)

    def one_side(own, everything, text, other, other_partial, lim, other_cut, partial) -> list[str]:
        out = []
        for t in own:
            if t.text in other or (other_partial and begins(t.text, other_partial)):
                continue
            if t.start >= lim:
                if other_cut:
                    continue  # the other side may say it past its budget
                if any(u.text == t.text for u in everything if u.end <= t.start):
                    continue  # the other side stopped; this repeats what was said
            out.append(_surface(t, text))
        across = other | ({other_partial} if other_partial else set())
        if partial and not any(begins(w, partial) for w in across):
            out.append(partial)
        return sorted(set(out))

    only_a = one_side(wa, all_a, ref, B, pb, lim_a, True, pa)  # the branch cut or stopped: not judged
    only_b = one_side(wb, all_b, branch, A, pa, lim_b, ref_cut, pb)
    ua, ub = _unmatched(only_a, only_b, word_similarity)
    # as sequences: inside the compared extent, every replaced, added or missing word must
    # be a synonym of one across (or lie past a cut end) for the change to be local
    reordered = False
    for op, i1, i2, j1, j2 in SequenceMatcher(None, [t.text for t in wa], [t.text for t in wb], autojunk=False).get_opcodes():
        if op == "equal":
            continue
        ga = [_surface(t, ref) for t in wa[i1:i2] if not t.start >= lim_a]
        gb = [_surface(t, branch) for t in wb[j1:j2] if not (ref_cut and t.start >= lim_b)]
        ra, rb = _unmatched(ga, gb, word_similarity)
        if ra or rb:
            reordered = True
            break
    return {"only_ref": ua, "only_branch": ub, "n_union": len(A | B), "n_ref": len(A), "n_branch": len(B),
            "reordered": reordered}


# The ends of two texts are aligned within their last this many characters (bounded work on
# long outputs; texts with nothing in common there are aligned from where they part).
END_WINDOW = 512


def _char_limits(ref: str, branch: str, start: int, a_len: int, b_len: int) -> tuple[float, float]:
    """Like :func:`_limits`, with the ends aligned by characters (the last common stretch of
    at least 3 characters in the last ``END_WINDOW`` of each): a prose text of a few repeated
    words aligns badly by words."""
    a0, b0 = max(start, a_len - END_WINDOW), max(start, b_len - END_WINDOW)
    blocks = [m for m in SequenceMatcher(None, ref[a0:a_len], branch[b0:b_len], autojunk=False).get_matching_blocks()
              if m.size >= 3]
    a_end, b_end = (a0 + blocks[-1].a + blocks[-1].size, b0 + blocks[-1].b + blocks[-1].size) if blocks else (start, start)
    return a_end + (b_len - b_end), b_end + (a_len - a_end)


def _partial_last(words: list[Tok], text: str, cut: bool, start: int) -> str | None:
    """The last word of a text cut by the budget (it may be cut inside), as written."""
    if cut and words and words[-1].end > start and words[-1].end >= len(text.rstrip()):
        return _surface(words[-1], text).rstrip("'’")
    return None


def _limits(before, ta: list[Tok], tb: list[Tok], a_len: int, b_len: int, start: int) -> tuple[float, float]:
    """Character offsets past which each side has nothing the other (cut) side could hold:
    from the last common token, as much text as the other side has left."""
    last = next(((i2, j2) for op, i1, i2, j1, j2 in reversed(before) if op == "equal"), None)
    a_end, b_end = (ta[last[0] - 1].end, tb[last[1] - 1].end) if last else (start, start)
    return a_end + (b_len - b_end), b_end + (a_len - a_end)


def _surface(t: Tok, text: str) -> str:
    return text[t.start : t.end].lower()


def _unmatched(a: list[str], b: list[str], word_similarity) -> tuple[list[str], list[str]]:
    """Words of each list that no word of the other stands for (cosine >= WORD_MATCH)."""
    if not a or not b or word_similarity is None:
        return a, b
    m = np.asarray(word_similarity(a, b), dtype=np.float64)
    return [w for w, row in zip(a, m) if row.max() < WORD_MATCH], [w for w, col in zip(b, m.T) if col.max() < WORD_MATCH]


def _rest_equal(ops, sa, sb, ref_cut: bool, branch_cut: bool) -> bool:
    """After a leading omission: equal to the end, but for a cut tail."""
    for op, i1, i2, j1, j2 in ops:
        if op == "equal":
            continue
        if (ref_cut and i1 == len(sa) and op == "insert") or (branch_cut and j1 == len(sb) and op == "delete"):
            continue
        return False
    return True


def _describe(op: str, a: list[tuple[str, str]], b: list[tuple[str, str]]) -> str:
    def show(x):
        return ", ".join(f"{k} {v}" for k, v in x[:3]) + (" ..." if len(x) > 3 else "")

    if op == "insert":
        return f"added {show(b)}"
    if op == "delete":
        return f"missing {show(a)}"
    return f"{show(a)} -> {show(b)}"


CODE_TAGS = ("code", "tool")


def prose_share(text: str) -> float:
    """Share of the text's non-blank characters that are prose (:func:`split_prose`): an
    answer in words to a code or tool request is prose, whatever the item's tags."""
    _, prose = split_prose(text)
    n_all, n_prose = len("".join(text.split())), len("".join(prose.split()))
    return n_prose / n_all if n_all else 0.0
_CODE_LINE = re.compile(r"^\s*(def |class |return\b|import |from \S+ import|if .*:$|for .*:$|elif |else:|try:|except|raise |@\w)|[=({\[]\s*$|\)\s*:?$")


def is_code(tags, text: str) -> bool:
    """Items tagged code or tool, or text whose non-blank lines mostly look like Python."""
    if any(t in CODE_TAGS for t in tags or ()):
        return True
    lines = [x for x in text.splitlines() if x.strip()]
    return len(lines) >= 3 and sum(bool(_CODE_LINE.search(x)) for x in lines) * 2 >= len(lines)
