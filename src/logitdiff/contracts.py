"""The report.json and summary.json contract, declared once.

* **Domain words**: flip outcomes, comparison kinds — one constant each, imported by every
  module that writes or reads them.
* **Shapes**: :class:`Report` (report.json) and :class:`RunSummary` (summary.json) with
  their nested sections as ``TypedDict``s. Writers build them, readers take them; the JSON
  Schemas shipped beside this module (``schemas/report.schema.json``,
  ``schemas/summary.schema.json``) say the same for other languages, and
  tests/test_report_schema.py keeps the two declarations equal.
* **Reading and writing**: :func:`load_report` / :func:`load_summary` parse and check a
  file (one-line :class:`LogitdiffError` naming file and field); :func:`report_json` /
  :func:`summary_json` give the exact bytes the writers store, validated against the schema
  when ``LOGITDIFF_VALIDATE_OUTPUTS`` is set (tests/conftest.py sets it, so every report
  any test writes is checked); :func:`json_clean` is the one numpy/NaN-to-JSON cleaner.

Versioning (docs/files.md, "Report schema"): ``schema`` names the document kind and its major
version (``logitdiff.report/2``); ``schema_version`` is ``MAJOR.MINOR``. Adding a field
bumps MINOR; removing or renaming one, or changing its meaning or type, bumps MAJOR.
Readers accept every MINOR of their MAJOR (unknown fields are allowed and ignored), and a
report.json of the previous MAJOR through :func:`migrate_report`, the one place that knows
what changed (docs/migration.md).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, TypedDict

import numpy as np

from .errors import LogitdiffError

# --------------------------------------------------------------------------------------
# the contract of every input file: a regular file, read with a size bound
# --------------------------------------------------------------------------------------

# A JSON or JSONL document read whole (a RUN's manifest.json, a chunk's items.jsonl, a
# report.json or summary.json, a workload): parsing holds ~10 bytes of Python objects per
# byte of text, so this is ~10 GiB of memory at most, the most one document may take on the
# machines logitdiff runs on. The largest real ones are far below it: a report.json of a
# 100k-position run is ~100 MB, a manifest ~200 bytes per chunk.
DOCUMENT_MAX_BYTES = 1 << 30
# A file read only for its first bytes or a small marker (the output guard's schema sniff)
SNIFF_BYTES = 4096


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _resolved_inside(path: Path, inside: str | Path) -> Path:
    """``path``'s real path when it lies inside ``inside`` (a RUN or REPORT directory);
    else a one-line error: a directory's files are its own, a symlink out of it is refused
    (a RUN moved or shared must not read, or hand out, another directory's bytes)."""
    real = Path(os.path.realpath(path))
    root = Path(os.path.realpath(inside))
    if root != real and root not in real.parents:
        raise LogitdiffError(f"{path}: a symlink out of {inside} (to {real}); the files of {inside} must lie inside it")
    return real


def open_input(path: str | Path, *, max_bytes: int, inside: str | Path | None = None) -> BinaryIO:
    """``path`` opened for reading as a regular file, or a one-line error naming it.

    Opened with O_NONBLOCK, so a FIFO cannot hang the command (a FIFO, a device such as
    /dev/zero, a socket or a directory is refused after ``fstat``, before any byte is read);
    its size, from the same ``fstat``, is checked against ``max_bytes`` before anything is
    allocated. With ``inside`` (the RUN or REPORT directory the file belongs to), a symlink
    is followed only when it resolves inside that directory. Callers read at most
    ``max_bytes`` + 1 bytes (a file growing while read is refused too: :func:`read_input_bytes`)."""
    path = Path(path)
    target = _resolved_inside(path, inside) if inside is not None else path
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if inside is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)  # the resolved path: a symlink now is a swap since the check
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        raise LogitdiffError(f"{path}: not found") from None
    except OSError as e:
        try:  # a socket cannot be opened at all (ENXIO): say what it is
            mode = os.stat(target).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise LogitdiffError(f"{path}: {_kind_of(mode)}, not a regular file; logitdiff reads its inputs from files") from None
        raise LogitdiffError(f"{path}: cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LogitdiffError(f"{path}: {_kind_of(st.st_mode)}, not a regular file; logitdiff reads its inputs from files")
        if st.st_size > max_bytes:
            raise LogitdiffError(f"{path}: {st.st_size} bytes, more than the {max_bytes} this input may hold")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input_bytes(path: str | Path, *, max_bytes: int, inside: str | Path | None = None) -> bytes:
    """The whole of the input file ``path`` (see :func:`open_input`), at most ``max_bytes``."""
    with open_input(path, max_bytes=max_bytes, inside=inside) as f:
        try:
            # the size fstat gave (one buffer, no growing copies), then whatever was appended since
            parts = [f.read(os.fstat(f.fileno()).st_size + 1)]
            got = len(parts[0])
            while got <= max_bytes and parts[-1]:
                parts.append(f.read(min(1 << 20, max_bytes + 1 - got)))
                got += len(parts[-1])
        except OSError as e:
            raise LogitdiffError(f"{path}: cannot read ({e.strerror})") from None
    if got > max_bytes:
        raise LogitdiffError(f"{path}: grew past {max_bytes} bytes while it was read")
    return parts[0] if len(parts) == 1 or not parts[1] else b"".join(parts)


def input_stat(path: str | Path, *, max_bytes: int, inside: str | Path | None = None) -> os.stat_result:
    """The checks of :func:`open_input` for a file another library opens by name (a memory
    map, pyarrow): its ``fstat``, or a one-line error."""
    with open_input(path, max_bytes=max_bytes, inside=inside) as f:
        return os.fstat(f.fileno())


def read_input_json(path: str | Path, *, max_bytes: int = DOCUMENT_MAX_BYTES, inside: str | Path | None = None) -> Any:
    """The JSON document in the input file ``path``, or a one-line error naming it (not a
    regular file, too large, not UTF-8, not JSON, nested beyond the recursion limit)."""
    raw = read_input_bytes(path, max_bytes=max_bytes, inside=inside)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LogitdiffError(f"{path}: not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise LogitdiffError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise LogitdiffError(f"{path}: JSON nested too deeply") from None


# The schema ids of every file logitdiff writes (the first key of each JSON file).
RUN_SCHEMA = "logitdiff.run/1"
REPORT_SCHEMA = "logitdiff.report/2"
# report.json of schema 1.x (the reference's side named "baseline"), read through migrate_report
REPORT_SCHEMA_1 = "logitdiff.report/1"
REPORT_SCHEMAS = (REPORT_SCHEMA_1, REPORT_SCHEMA)  # the report.json kinds this logitdiff reads
RUN_SUMMARY_SCHEMA = "logitdiff.run-summary/1"
TOPK_ERROR_SCHEMA = "logitdiff.topk-error/1"
LAYERS_SCHEMA = "logitdiff.layers/1"
SPECULATION_SCHEMA = "logitdiff.speculation/1"
QUANTIZE_SCHEMA = "logitdiff.quantize/1"
# report.html carries this in its <head>; pages written before it carried the data schema.
HTML_GENERATOR_META = '<meta name="generator" content="logitdiff">'
HTML_DATA_SCHEMA = "logitdiff.html-data/1"

SCHEMA_VERSION = "2.2"  # MAJOR.MINOR of report.json; MAJOR matches REPORT_SCHEMA's "/2"
# 2.1: flip classes decided by rules only (Outcome.RULE), flips.meaning_judged_by; 2.2: correctness.attribution
# MAJOR.MINOR of summary.json, MAJOR matching RUN_SUMMARY_SCHEMA's "/1": the rename of report.json 2.0
# (baseline -> reference) left summary.json as it was (its reference was always "reference")
SUMMARY_SCHEMA_VERSION = "1.5"  # 1.3: cross_engine_floor_rule; 1.4: rule-decided flip outcomes, flip_meaning_judged_by;
# 1.5: right_to_truncated, accuracy CIs, measure, attributed
VALIDATE_ENV = "LOGITDIFF_VALIDATE_OUTPUTS"  # set (non-empty, not "0"): writers validate against the schema
SCHEMA_DIR = Path(__file__).with_name("schemas")
SPECULATION_SCHEMA_VERSION = "1.2"  # MAJOR.MINOR of a `logitdiff speculate` report.json (logitdiff.speculation/1)


# --------------------------------------------------------------------------------------------
# domain words


class Outcome:
    """What a branch taken at a top-1 flip did (flips.classify), mildest first."""

    RECOVERED = "recovered"
    BENIGN = "benign"
    MEANING_CHANGED = "meaning_changed"
    TOOL_CALL_MALFORMED = "tool_call_malformed"
    TOOL_CALL_CHANGED = "tool_call_changed"
    # Decided by a rule anyone can re-run (issue #37): a checker's verdict on the branch's
    # answer, the item's tests, or -- an unlabelled text that did not come back -- no claim.
    ANSWER_SAME = "answer_same"
    ANSWER_CHANGED = "answer_changed"
    TESTS_PASSED = "tests_passed"
    TESTS_FAILED = "tests_failed"
    DIVERGED = "diverged"
    # What flips.classify decides by default: the alignment and the item's checkers only.
    RULE = (RECOVERED, ANSWER_SAME, TESTS_PASSED, DIVERGED, ANSWER_CHANGED, TESTS_FAILED, TOOL_CALL_CHANGED,
            TOOL_CALL_MALFORMED)
    # BENIGN / MEANING_CHANGED: only a named judge (--judge SOURCE) decides these, turning a
    # diverged branch into one of them. A report without a judge carries neither.
    JUDGED = (BENIGN, MEANING_CHANGED)
    ALL = RULE + JUDGED
    # the outcomes a reader should worry about ("consequential" flips); diverged is neither
    # bad nor harmless: its meaning was not judged
    BAD = (ANSWER_CHANGED, TESTS_FAILED, TOOL_CALL_MALFORMED, TOOL_CALL_CHANGED, MEANING_CHANGED)
    TEXT = {
        RECOVERED: "the branch re-joined the reference's continuation and stayed joined (and the item's checker, "
                   "where it has one, gives the same verdict)",
        ANSWER_SAME: "the branch did not stay joined; the item's checker finds the same answer",
        TESTS_PASSED: "the branch did not stay joined; its program passes the item's tests",
        DIVERGED: "the branch did not stay joined and the item has no checker: meaning not judged",
        ANSWER_CHANGED: "the item's checker finds another answer in the branch",
        TESTS_FAILED: "the branch's program fails the item's tests",
        TOOL_CALL_CHANGED: "the branch's tool call is valid but different",
        TOOL_CALL_MALFORMED: "the branch's tool call no longer parses/validates",
        BENIGN: "a named judge (--judge) finds the diverged branch says the same",
        MEANING_CHANGED: "a named judge (--judge) finds the diverged branch says something else",
    }

    @classmethod
    def occurring(cls, *counts: Mapping[str, Any]) -> tuple[str, ...]:
        """The outcomes with a non-zero count in any of ``counts`` (report.json flips.outcomes,
        or its groups), in ALL's order: what a table shows (ten columns would not fit)."""
        return tuple(o for o in cls.ALL if any(isinstance(c, Mapping) and (c.get(o) or 0) for c in counts))


class JudgeVerdict:
    """What a judge (flips.judge, ``--judge SOURCE``) answered about a diverged branch: the two
    continuations say the same thing, something different, or an answer its parse rule does not
    read (the branch stays ``diverged``)."""

    SAME = "same"
    DIFFERENT = "different"
    UNPARSED = "unparsed"
    ALL = (SAME, DIFFERENT, UNPARSED)


class Verdict:
    """How one free-running output was graded against its label (grading.grade)."""

    RIGHT = "right"
    WRONG = "wrong"
    # the output hit the token budget (no end token) and is not right: it was cut before it
    # could finish, which says nothing about whether the model would have been wrong
    TRUNCATED = "truncated"
    ALL = (RIGHT, WRONG, TRUNCATED)


class AnswerChange:
    """Which way one labelled item's free-running answer changed, reference -> candidate
    (consequences.correctness_section). Right -> truncated (the candidate's output cut at the
    token budget, not right) is an answer that changed, as right -> wrong is."""

    RIGHT_TO_WRONG = "right_to_wrong"
    RIGHT_TO_TRUNCATED = "right_to_truncated"
    WRONG_TO_RIGHT = "wrong_to_right"
    ALL = (RIGHT_TO_WRONG, RIGHT_TO_TRUNCATED, WRONG_TO_RIGHT)
    ARROW = {RIGHT_TO_WRONG: "right→wrong", RIGHT_TO_TRUNCATED: "right→truncated", WRONG_TO_RIGHT: "wrong→right"}
    # the correctness fields holding each direction's count and item list
    COUNT_FIELD = {RIGHT_TO_WRONG: "right_to_wrong", RIGHT_TO_TRUNCATED: "right_to_truncated", WRONG_TO_RIGHT: "wrong_to_right"}
    ITEMS_FIELD = {RIGHT_TO_WRONG: "items_right_to_wrong", RIGHT_TO_TRUNCATED: "items_right_to_truncated",
                   WRONG_TO_RIGHT: "items_wrong_to_right"}


class Measure:
    """What the share of right answers is called (``correctness.measure``): a benchmark
    graded by its own tests or checker (``--workload humaneval:N``, ``bfcl:CATEGORY:N``: the
    reference RUN's workload names one) has a pass rate, any other labelled workload an accuracy."""

    ACCURACY = "accuracy"
    PASS_RATE = "pass rate"
    ALL = (ACCURACY, PASS_RATE)


class CallVerdict:
    """How one output's tool call was checked (parse + the tool's JSON Schema)."""

    VALID = "valid"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"  # not valid, and the output hit the token budget
    ALL = (VALID, MALFORMED, TRUNCATED)


class PromptForm:
    """How a HumanEval item was put to the model (``expected.tests.prompt_form`` of an item,
    ``prompt_form`` of a correctness row, ``correctness.prompt_forms`` of report.json). Chosen
    per source by whether it renders chat messages (logitdiff.sources.prompt_form); absent
    means COMPLETION (items made before the choice)."""

    FIELD = "prompt_form"
    # EvalPlus's instruction prompt as one user turn; the code is the answer's first fenced block
    EVALPLUS_INSTRUCT = "evalplus_instruct"
    COMPLETION = "completion"  # the benchmark's raw prompt, completed; cut at the Codex stop sequences
    ALL = (EVALPLUS_INSTRUCT, COMPLETION)
    MEANS = {EVALPLUS_INSTRUCT: "EvalPlus instruction prompt through the chat template, code from the answer's first fenced block",
             COMPLETION: "raw completion prompt (the benchmark's own form)"}
class ToolForm:
    """How a benchmark item's functions reached the model (``expected.bfcl.tool_form`` of an
    item, ``tool_form`` of a correctness row, ``correctness.tool_forms`` of report.json).
    Chosen per source by whether its chat template renders tools
    (logitdiff.sources.tool_form); absent means CHAT_TEMPLATE (items made before the choice)."""

    FIELD = "tool_form"
    CHAT_TEMPLATE = "chat_template"  # messages + tools= to the template; answers parsed as Hermes <tool_call> blocks
    BFCL_PROMPT = "bfcl_prompt"  # BFCL's prompting-mode system prompt with the function docs; BFCL's prompting decoder
    ALL = (CHAT_TEMPLATE, BFCL_PROMPT)
    MEANS = {CHAT_TEMPLATE: "tools via the chat template",
             BFCL_PROMPT: "BFCL plain prompt (prompting mode), template has no tool support"}


class MethodKind:
    """``method.kind`` of a report: what was compared (the bound method names are bounds.METHOD_*)."""

    FULL_VOCAB = "full_vocab"  # full logits on both sides: exact
    COMPACT = "compact"  # compact reference store vs full candidate: bounded
    TOP_K = "top_k"  # top-K on at least one side: seed estimate + bounds
    ALL = (FULL_VOCAB, COMPACT, TOP_K)


# --------------------------------------------------------------------------------------------
# shapes (``total=False`` classes hold the optional keys; JSON null is ``None``)


class Stats(TypedDict):
    """summarize.describe + the item-bootstrap CI of the mean."""

    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    p99_9: float | None
    max: float | None
    ci95: list[float | None]


class Top1Disagreement(TypedDict):
    rate: float | None
    mismatches: int
    ci95: list[float | None]


class _GroupBase(TypedDict):
    n: int
    n_items: int


class GroupStats(_GroupBase, total=False):
    """A summarize.summarize_group result: one row of ranges/tags/segments/items."""

    group: str  # ranges, tags, segments
    id: str  # items
    tags: list[str]  # items
    kl_nats: Stats
    kl_rev_nats: Stats
    jsd_nats: Stats
    top1_disagreement: Top1Disagreement
    nll_ref_mean: float
    nll_cand_mean: float
    ppl_ref: float
    ppl_cand: float
    ppl_ratio: float


class NoiseFloor(TypedDict):
    """The reference against a rerun of itself (report.noise_floor_section builds it)."""

    spec: str | None  # the reference's source spec
    rerun: str  # what the rerun was (same batch layout, other batch mates, which RUN)
    kl_nats_mean: float
    kl_nats_max: float
    top1_disagreement: float
    top1_flips: int
    positions: int


class ServedFloorSide(TypedDict):
    """One served side captured twice with other batch mates (servedfloor.floor_side)."""

    spec: str | None  # the served source's spec
    batching: str | None  # the source's batching= mode (rounds, serial)
    measured_by: str  # how the second capture differed (batch boundaries, round order)
    kl_nats_mean: float
    kl_nats_max: float
    top1_disagreement: float
    positions: int


class ServedFloor(TypedDict):
    """schema 1.2: how much a server's own arithmetic moves its rows (servedfloor.served_floor)."""

    kl_nats_mean: float | None  # the floor a served figure is read against (rule says which)
    rule: str
    reference: ServedFloorSide | None
    candidate: ServedFloorSide | None


class Side(TypedDict):
    """``reference`` / ``candidate``: which RUN (or live source) and how it was stored."""

    path: str
    served_model: str | None
    spec: str | None
    identity: dict[str, Any] | None  # free-form: what the source records about itself
    status: str | None
    tokenizer_hash: str | None
    store: str | None
    dtype: str | None
    n_items: int | None
    n_positions: int | None
    role: str


class Bootstrap(TypedDict):
    resample: str
    n: int
    seed: int
    level: float


class _MethodBase(TypedDict):
    description: str
    kind: str  # MethodKind
    bounds: str  # bounds.METHOD_*
    epsilon: float
    top_logprobs: int
    vocab_size: int
    topk_overlap_k: int | None
    log: str
    precision: str
    reference_dtype: str | None
    candidate_dtype: str | None
    bootstrap: Bootstrap
    ranges: list[int]
    notes: list[str]


class Method(_MethodBase, total=False):
    positions: dict[str, Any]  # --positions sampling (mode, fraction, seed, rule)
    logprob_floor_nats: float  # 1.1: the stated --logprob-floor of a top-K comparison
    served_batching: dict[str, str | None]  # 1.2: batching= of each served side (reference, candidate)


class _SummaryBase(TypedDict):
    # the seed report's summary fields (its "baseline" is the reference: reference_* since schema 2.0)
    reference_top_mass_mean: float | None
    candidate_top_mass_mean: float | None
    kl_bits_max: float | None
    kl_bits_mean: float | None
    kl_nats_max: float | None
    kl_nats_mean: float | None
    kl_nats_p50: float | None
    kl_nats_p95: float | None
    max_kl_reference_top_token: str | None
    max_kl_candidate_top_token: str | None
    max_kl_source_id: str | None
    max_kl_position: int | None
    paired_prompts: int
    shared_reference_mass_mean: float | None
    top1_match_rate: float | None
    top1_matches: int
    top1_mismatches: int
    # ours
    positions: int
    top1_disagreement: Top1Disagreement | None
    metrics: dict[str, Stats]  # kl_nats, kl_rev_nats, jsd_nats


class Summary(_SummaryBase, total=False):
    ppl_ref: float
    ppl_cand: float
    ppl_ratio: float
    nll_ref_mean: float
    nll_cand_mean: float
    noise_floor: NoiseFloor
    kl_mean_x_noise_floor: float | None
    served_floor: ServedFloor  # 1.2: served sides captured again with other batch mates
    kl_mean_x_served_floor: float | None  # 1.2
    within_2x_served_floor: bool  # 1.2
    # bounded methods (compact.INTERVAL_COLUMNS): NAME_lower_nats_mean, NAME_upper_nats_mean
    # and NAME_interval_width_mean for NAME in kl, kl_rev, jsd (keys built from the names);
    # schema 1.2: NAME_upper_uninformative (bool), true when the interval's mean width exceeds
    # the estimate (infinite width included): the interval is read from its lower end


class OutcomeGroup(TypedDict, total=False):
    """Outcome counts of one group of branches (by_tag / by_range / by_margin): a count per
    Outcome.ALL name, ``n`` and ``rates``."""

    n: int
    rates: dict[str, float | None]


class FlipTies(TypedDict):
    tolerance: str
    n_branched: int
    outcomes: dict[str, int]
    list: list[dict[str, Any]]


class _FlipsBase(TypedDict):
    n_flips: int
    flip_rate: float | None
    n_ties: int
    n_branches: int
    selection: str
    similarity: str
    settings: dict[str, Any]
    outcomes: dict[str, int]  # Outcome.RULE (and a judge's Outcome.JUDGED, where one ran) -> count
    rates: dict[str, float | None]  # the same names -> share of branches
    # 2.1: the judge that decided benign / meaning_changed (None: no judge, the meaning of a
    # diverged branch was not judged); a migrated 2.0 report: OLD_CLASSIFIER
    meaning_judged_by: str | None
    recovered_ending_dissimilar: int
    by_tag: dict[str, OutcomeGroup]
    by_range: dict[str, OutcomeGroup]
    by_margin: dict[str, OutcomeGroup]
    top: list[dict[str, Any]]  # flips.SHOWN_FIELDS
    ties: FlipTies


class Flips(_FlipsBase, total=False):
    both: dict[str, Any]  # branches from both tokens (flips --both)
    # schema 1.2: where the token the reference wrote is not its own scored top-1
    reference_self_consistency: dict[str, Any]
    # schema 1.2: selected flips the --max-branches cap left out (n, list)
    left_out: dict[str, Any]
    # schema 1.2: items whose answer or tool call changed (correctness), and whether the flip behind each was branched
    changed_items: list[dict[str, Any]]
    # schema 1.2: branches and reference outputs that hit the token budget
    outputs_cut: dict[str, Any]
    # schema 2.1: the judge of --judge SOURCE (flips.judge.Judge.section): who judged diverged branches, how, and its measured agreement
    judge: dict[str, Any]


class _CorrectnessBase(TypedDict):
    n_labelled: int
    accuracy_ref: float | None
    accuracy_ref_ci: list[float | None]
    accuracy_cand: float | None
    accuracy_cand_ci: list[float | None]
    accuracy_diff: float | None
    accuracy_diff_ci: list[float | None]
    both_right: int
    both_wrong: int
    right_to_wrong: int
    wrong_to_right: int
    correctness_flips: int
    mcnemar_p: float | None
    flips_starting_at_top1_flip: int
    flips_with_unscored_start: int
    method: str
    items_right_to_wrong: list[str]
    items_wrong_to_right: list[str]
    by_tag: dict[str, dict[str, Any]]


class FirstFlip(TypedDict):
    """The first teacher-forced top-1 flip on an item (flips.find_flips; a tie at the
    reference, flips.is_tie, is not a flip): tokens.parquet's figures at that position."""

    position: int
    ref_token_id: int
    cand_token_id: int
    ref_token: str
    cand_token: str
    p_ref: float | None  # the reference's probability of its own top-1 (null: not stored)
    p_cand: float | None  # the candidate's probability of its own top-1
    margin_ref: float
    kl_nats: float


class AttributedBranch(TypedDict):
    """The branch the flips stage took on the item (flips.parquet row: item_id + position)."""

    position: int
    outcome: str
    decided_by: str
    at_first_flip: bool | None  # false: the branch is at another of the item's flips (the one behind the divergence); null: not recorded


class Attribution(TypedDict):
    """One labelled item whose free-running answer changed (an AnswerChange), linked to the first
    teacher-forced top-1 flip on it and the branch taken there (schema 2.2)."""

    item_id: str
    direction: str  # AnswerChange.ALL
    first_flip: FirstFlip | None
    no_flip: str | None  # why first_flip is null (no flip on the item, only ties, not recorded)
    first_divergence: int | None  # where the two free-running outputs first differ (output position)
    divergence_at_first_flip: bool | None  # the outputs part at that flip (null: no flip or no divergence)
    branch: AttributedBranch | None
    not_branched: str | None  # why the first flip has no branch (null: it has one)


class AttributedCounts(TypedDict):
    """The attribution records counted (:func:`attributed_counts`): every surface prints these."""

    n: int  # items whose answer changed (right->wrong + right->truncated + wrong->right)
    with_flip: int | None  # of them, with a teacher-forced flip (null: not recorded, a migrated report)
    divergence_at_first_flip: int | None  # of them, whose free-running outputs part at that flip
    branched: int  # of them, with a branch taken on the item
    outcomes: dict[str, int]  # the branches' outcomes


class Correctness(_CorrectnessBase, total=False):
    tool_call_valid_ref: float
    tool_call_valid_cand: float
    n_tool_items: int
    # schema 1.2: outputs that hit the token budget; graded Verdict.TRUNCATED when not right
    budget_tokens: int | None
    cut_ref: int
    cut_cand: int
    truncated_ref: int
    truncated_cand: int
    right_to_truncated: int
    items_right_to_truncated: list[str]
    tool_call_truncated_ref: int
    tool_call_truncated_cand: int
    # how HumanEval items were put to the model: PromptForm name -> {"n", "means"}
    prompt_forms: dict[str, dict[str, Any]]
    # how the functions of benchmark items reached the model: ToolForm name -> {"n", "means"}
    tool_forms: dict[str, dict[str, Any]]
    # schema 2.2: what the share of right answers is called (Measure), and the benchmark behind it
    measure: str
    benchmark: str | None
    # schema 2.2: each changed answer linked to its first teacher-forced flip and branch, and the counts
    attribution: list[Attribution]
    attributed: AttributedCounts


class _GateResultBase(TypedDict):
    gate: str
    metric: str
    op: str
    threshold: float
    value: float | None
    crossed: bool
    missing: bool  # the metric is not in the report: the gate is not evaluated (never crossed, since 1.2)


class GateResult(_GateResultBase, total=False):
    kind: str  # gates.GateKind: fail_on (a failure condition) or require (must hold); 1.2
    reason: str  # why a missing metric is missing; 1.2


class _GatesBase(TypedDict):
    gates: list[GateResult]
    crossed: list[str]
    passed: bool  # every gate evaluated and none crossed (since 1.2)


class Gates(_GatesBase, total=False):
    not_evaluated: list[str]  # gates whose metric the report lacks; 1.2


class Tool(TypedDict):
    name: str
    version: str


class _ReportBase(TypedDict):
    schema: str  # REPORT_SCHEMA
    schema_version: str  # SCHEMA_VERSION
    tool: Tool
    created: str
    machine: dict[str, Any]
    reference: Side  # 2.0: "baseline" in schema 1.x
    candidate: Side
    method: Method
    rows: list[dict[str, Any]]  # the seed's row fields + every per-position metric
    summary: Summary
    ranges: list[GroupStats]
    tags: list[GroupStats]
    segments: list[GroupStats]
    items: list[GroupStats]


class Report(_ReportBase, total=False):
    rows_omitted: bool
    flips: Flips
    correctness: Correctness
    gates: Gates


class SpeculationVerdict(TypedDict):
    """``verdict`` of a generation-mode report: ``label`` is one of speculation.VERDICTS."""

    label: str
    defects: list[str]
    reasons: list[str]


class SpeculationReport(TypedDict):
    """report.json of ``logitdiff speculate`` (schema ``logitdiff.speculation/1``,
    schemas/speculation.schema.json): speculation on vs off in generation mode."""

    schema: str  # contracts.SPECULATION_SCHEMA
    schema_version: str  # SPECULATION_SCHEMA_VERSION
    tool: Tool
    created: str
    reference: dict[str, Any]  # server identity (/props, /slots) + counters
    candidate: dict[str, Any]  # the same + declared_speculative
    method: dict[str, Any]  # mode "generation", the request body, n_predict, K, floors' settings, notes
    floors: dict[str, Any]  # F0 (reference, candidate reruns), F1 (shape floor)
    summary: dict[str, Any]
    survival: dict[str, list[float]]  # candidate, F0_reference, F0_candidate, F1: share identical at position t
    items: list[dict[str, Any]]  # per item: first divergence, margins, class, counters
    verdict: SpeculationVerdict
    timing: dict[str, Any]


class CrossEngineFloor(TypedDict):
    candidate: str
    kl_nats_mean: float


class _CandidateRowBase(TypedDict):
    candidate: str
    name: str
    report: str
    kl_mean: float | None
    kl_mean_ci95: list[float | None]
    kl_p99: float | None
    kl_max: float | None
    kl_rev_mean: float | None
    jsd_mean: float | None
    top1_disagreement: float | None
    top1_disagreement_ci95: list[float | None]
    ppl_ratio: float | None
    x_noise_floor: float | None
    within_2x_noise_floor: bool
    x_cross_engine_floor: float | None


class CandidateRow(_CandidateRowBase, total=False):
    flip_branches: int
    flip_ties: int
    flip_outcomes: dict[str, int]
    flips_consequential: int
    flip_meaning_judged_by: str | None  # 1.4: report.json flips.meaning_judged_by
    accuracy_ref: float | None
    accuracy_cand: float | None
    right_to_wrong: int
    wrong_to_right: int
    mcnemar_p: float | None
    tool_call_valid_cand: float | None
    right_to_truncated: int  # 1.4
    accuracy_ref_ci: list[float | None]  # 1.4
    accuracy_cand_ci: list[float | None]  # 1.4
    correctness_measure: str  # 1.4: Measure
    attributed: AttributedCounts  # 1.4
    gates_crossed: list[str]
    gates_not_evaluated: list[str]
    x_served_floor: float | None  # 1.2
    within_2x_served_floor: bool  # 1.2


class _RunSummaryBase(TypedDict):
    schema: str  # RUN_SUMMARY_SCHEMA
    schema_version: str  # SUMMARY_SCHEMA_VERSION
    reference: str
    workload: str
    workload_sha256: str
    items: int
    positions: int
    noise_floor: NoiseFloor | None
    cross_engine_floor: CrossEngineFloor | None
    candidates: list[CandidateRow]
    seconds: float


class RunSummary(_RunSummaryBase, total=False):
    cross_engine_floor_rule: str  # how the floor was chosen, or why there is none (1.3)
    gates: list[str]
    gates_crossed: dict[str, list[str]]
    gates_not_evaluated: dict[str, list[str]]


# layers.json (``logitdiff layers``): its own document kind, ``logitdiff.layers/1``, versioned
# like report.json (schema_version 1.x); schemas/layers.schema.json says the same.


class LayersGeometry(TypedDict):
    family: str  # architecture family (layers.FAMILIES)
    n_layer: int
    hidden_size: int
    points: list[str]  # the compared points, in order: "embedding"?, "layer 0" .. "layer L-1"
    window_tokens: int  # tokens per forward pass
    chunk_bytes: int


class LayersPerPoint(TypedDict):
    """One list per figure, one entry per point (JSON null: undefined or infinite)."""

    rel_l2_median: list[float | None]
    rel_l2_p95: list[float | None]
    rel_l2_mean: list[float | None]
    cosine_median: list[float | None]
    cosine_p5: list[float | None]
    sqnr_db_median: list[float | None]
    growth: list[float | None]  # median rel_l2 / previous point's; first: null
    added_rel_l2_median: list[float | None]  # median of |e - e_prev| / |r|, e = c - r: the error a layer adds
    spearman_kl_median: list[float | None]  # median over items of the per-item rank correlation


class LayersItem(TypedDict):
    id: str
    n: int
    kl_mean_nats: float | None
    spearman_rel_l2_kl: list[float | None]  # per point, across the item's positions


class LayersComparison(TypedDict):
    """A candidate (or the floor) against the reference."""

    spec: str
    engine: str  # hf | gguf
    identical: bool  # every hidden state and every KL exactly equal to the reference's
    per_point: LayersPerPoint
    first_beyond_floor: int | None  # index into geometry.points; null: none (or no floor)
    top_added: list[int]  # indices of the points adding the most error (added_rel_l2_median), largest first
    kl_mean_nats: float | None
    top1_disagreement: float | None
    items: list[LayersItem]


class LayersRef(TypedDict):
    spec: str
    engine: str


class LayersMethod(TypedDict):
    point: str
    metrics: str
    floor: str
    beyond_floor: str
    kl: str
    layout: str


class LayersDoc(TypedDict):
    schema: str
    schema_version: str
    reference: LayersRef
    teacher: str
    n_items: int
    n_positions: int
    geometry: LayersGeometry
    method: LayersMethod
    floor: LayersComparison | None
    candidates: list[LayersComparison]


# --------------------------------------------------------------------------------------------
# JSON


def json_clean(obj: Any, *, default: Callable[[Any], Any] | None = None) -> Any:
    """JSON-safe copy: numpy scalars/arrays -> Python, NaN/inf -> None (JSON null), tuples ->
    lists, recursively. Other objects stay as they are, or become ``default(obj)`` (e.g.
    ``str`` for paths) when given."""
    # Exact-type fast paths first: a report holds a few hundred thousand plain values, and
    # the isinstance chain below costs more than the JSON encoding of them.
    t = type(obj)
    if t is float:
        return obj if math.isfinite(obj) else None
    if t is str or t is int or t is bool or obj is None:
        return obj
    if t is dict:
        return {k: json_clean(v, default=default) for k, v in obj.items()}
    if t is list:
        return [json_clean(v, default=default) for v in obj]
    if isinstance(obj, dict):
        return {k: json_clean(v, default=default) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v, default=default) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_clean(obj.tolist(), default=default)
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return x if math.isfinite(x) else None
    if default is not None and not isinstance(obj, (str, int, type(None))):
        return default(obj)
    return obj


@lru_cache(maxsize=None)
def schema(name: str) -> dict[str, Any]:
    """The shipped JSON Schema ``report`` or ``summary``."""
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


def validation_on() -> bool:
    return os.environ.get(VALIDATE_ENV, "") not in ("", "0")


def validate(obj: Any, name: str, where: str = "") -> None:
    """A one-line LogitdiffError naming the first field that breaks schema ``name``."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(name))
    # the first error in document order (paths compared as text: a path mixes keys and indices)
    err = min(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path], default=None)
    if err is not None:
        field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise LogitdiffError(f"{where or name}: field {field!r} breaks the {name} schema: {err.message[:300]}")


def _layout(doc: Any, **dump: Any) -> str:
    """The text of a report or summary: indented one space per level, except the per-position
    ``rows``, one compact JSON object per line. Rows are most of a report's bytes, and the
    json module encodes indented output in pure Python but compact output in C: ~3x faster
    for them (bench/RESULTS.md, "compare end to end"), and a file that greps by row."""
    rows = doc.get("rows") if type(doc) is dict else None
    if not (type(rows) is list and rows):
        return json.dumps(doc, indent=1, allow_nan=False, **dump)
    encode_row = json.JSONEncoder(allow_nan=False, separators=(", ", ": "), **dump).encode
    parts = []
    for key, value in doc.items():
        if key == "rows":
            text = "[\n  " + ",\n  ".join(map(encode_row, rows)) + "\n ]"
        else:  # JSON strings hold no raw newline: every newline is layout, indented one more
            text = json.dumps(value, indent=1, allow_nan=False, **dump).replace("\n", "\n ")
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}"


def _text(obj: Any, name: str, where: str, **dump: Any) -> str:
    clean = json_clean(obj)
    if validation_on():
        validate(json.loads(json.dumps(clean, allow_nan=False, **dump)), name, where)
    return _layout(clean, **dump) + "\n"


def report_json(report: Report, where: str = "report.json") -> str:
    """The text of report.json (strict JSON: NaN/inf are null)."""
    return _text(report, "report", where)


def summary_json(summary: RunSummary, where: str = "summary.json") -> str:
    """The text of summary.json."""
    return _text(summary, "summary", where, default=str)


def layers_json(doc: LayersDoc, where: str = "layers.json") -> str:
    """The text of layers.json (strict JSON: NaN/inf are null), validated like report.json."""
    return _text(doc, "layers", where)


def load_layers(path: str | Path) -> LayersDoc:
    """layers.json of a `logitdiff layers` REPORT (the directory or the file), checked."""

    return _load_checked(path, "layers.json", "layers REPORT directory", LAYERS_SCHEMA, "layers")  # type: ignore[return-value]


def _accepts(doc: dict, kinds: str | tuple[str, ...], path: Path) -> None:
    """``doc``'s kind is one of ``kinds`` and its schema_version's MAJOR the kind's (the digits
    after the id's "/"): a one-line error otherwise."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    if not isinstance(doc, dict) or doc.get("schema") not in kinds:
        got = doc.get("schema") if isinstance(doc, dict) else None
        raise LogitdiffError(f"{path}: field 'schema' is {got!r}, this logitdiff reads {' or '.join(map(repr, kinds))}")
    ver = doc.get("schema_version")
    if ver is None:
        return  # written before schema_version existed: same MAJOR (the schema field says so), minor 0
    major = str(doc["schema"]).rsplit("/", 1)[1]
    if str(ver).split(".", 1)[0] != major:
        raise LogitdiffError(f"{path}: field 'schema_version' is {ver!r}, but field 'schema' is {doc['schema']!r}: "
                             f"this logitdiff reads {major}.x there")


# --------------------------------------------------------------------------------------------
# schema 1.x -> 2.0 (docs/migration.md): the reference RUN's side, and every field named after
# it, were "baseline" (the seed report's word); since 2.0 the reference has one name.

# report.json keys: the top level (the reference's Side) and the summary
RENAMED_IN_2 = {
    "baseline": "reference",
    "baseline_top_mass_mean": "reference_top_mass_mean",
    "max_kl_baseline_top_token": "max_kl_reference_top_token",
    "shared_baseline_mass_mean": "shared_reference_mass_mean",
}
# per-position fields: report.json's rows and tokens.parquet's columns
RENAMED_COLUMNS_IN_2 = {
    "baseline_top_mass": "reference_top_mass",
    "baseline_top_token": "reference_top_token",
    "baseline_top_token_id": "reference_top_token_id",
    "shared_baseline_mass": "shared_reference_mass",
}


def migrate_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """Per-position columns (tokens.parquet's, or one row of report.json) under their 2.0
    names (RENAMED_COLUMNS_IN_2), in their order; columns of a 2.x report come back as they are."""
    if not any(k in RENAMED_COLUMNS_IN_2 for k in columns):
        return columns
    return {RENAMED_COLUMNS_IN_2.get(k, k): v for k, v in columns.items()}


# A report written before 2.1: its benign / meaning_changed counts were decided by the
# classifier of that time (similarity and salient checks, no judge); they are kept as they
# were and said to be that classifier's.
OLD_CLASSIFIER = "logitdiff's classifier before report 2.1 (similarity and salient checks, not a judge)"


def attributed_counts(records: list[Attribution]) -> AttributedCounts:
    """The attribution records counted: how many changed answers have a teacher-forced flip,
    part there, have a branch, and the branches' outcomes (the one count every surface prints)."""
    recorded = not any(r["no_flip"] == NOT_RECORDED for r in records)
    outcomes: dict[str, int] = {}
    for r in records:
        if r["branch"] is not None:
            outcomes[r["branch"]["outcome"]] = outcomes.get(r["branch"]["outcome"], 0) + 1
    return {
        "n": len(records),
        "with_flip": sum(r["first_flip"] is not None for r in records) if recorded else None,
        "divergence_at_first_flip": sum(bool(r["divergence_at_first_flip"]) for r in records) if recorded else None,
        "branched": sum(r["branch"] is not None for r in records),
        "outcomes": dict(sorted(outcomes.items())),
    }


# no_flip of an attribution record migrated from a report written before schema 2.2
NOT_RECORDED = "not recorded: the report predates schema 2.2 (logitdiff flips REPORT/ records the flip)"


def _migrate_attribution(doc: dict) -> None:
    """A report before 2.2 with a correctness section: one record per changed answer from its
    item lists, its branch from flips.changed_items where that lists one; the flip itself is not
    recorded in such a report (NOT_RECORDED), and nothing is guessed."""
    c = doc.get("correctness")
    if not isinstance(c, dict) or "attribution" in c:
        return
    listed = {x.get("item_id"): x for x in (doc.get("flips") or {}).get("changed_items") or [] if isinstance(x, dict)}
    records: list[Attribution] = []
    for direction in AnswerChange.ALL:
        for iid in c.get(AnswerChange.ITEMS_FIELD[direction]) or []:
            x = listed.get(iid) or {}
            branch: AttributedBranch | None = None
            if x.get("branched"):
                branch = {"position": x["position"], "outcome": x["outcome"], "decided_by": "", "at_first_flip": None}
            records.append({"item_id": iid, "direction": direction, "first_flip": None, "no_flip": NOT_RECORDED,
                            "first_divergence": None, "divergence_at_first_flip": None, "branch": branch,
                            "not_branched": None if branch else (x.get("why_not") or "not recorded (no flips section)")})
    c["attribution"] = records
    c["attributed"] = attributed_counts(records)
    if doc.get("schema_version") is not None:
        doc["schema_version"] = SCHEMA_VERSION


def migrate_report(doc: Any, where: str | Path = "report.json") -> Report:
    """A report.json object of any schema this logitdiff reads, as the current one: kind and
    major version checked (a one-line error naming ``where``), a current report returned as
    it is, a 1.x report as 2.x with the keys of RENAMED_IN_2 (top level, summary) and
    RENAMED_COLUMNS_IN_2 (rows) renamed in place: same order, every value as it was. A
    report before 2.1 with a flips section gets ``flips.meaning_judged_by`` = OLD_CLASSIFIER
    (its outcome counts as they were: the old classifier's benign / meaning_changed); a
    correctness section written before 2.2 is given its ``attribution`` records
    (:func:`_migrate_attribution`: what the report holds, the flips marked NOT_RECORDED).

    The one place an older report becomes a current one: every reader goes through it
    (:func:`load_report` does), and the JSON Schema check comes after it."""
    _accepts(doc, REPORT_SCHEMAS, Path(where))
    if doc["schema"] == REPORT_SCHEMA and not _flips_before_2_1(doc):
        _migrate_attribution(doc)
        return doc
    out: dict[str, Any] = {"schema": REPORT_SCHEMA, "schema_version": SCHEMA_VERSION}
    out.update((RENAMED_IN_2.get(k, k), v) for k, v in doc.items() if k not in out)
    if isinstance(out.get("summary"), dict):
        out["summary"] = {RENAMED_IN_2.get(k, k): v for k, v in out["summary"].items()}
    if isinstance(out.get("rows"), list):
        out["rows"] = [migrate_columns(r) if isinstance(r, dict) else r for r in out["rows"]]
    if isinstance(out.get("flips"), dict) and "meaning_judged_by" not in out["flips"]:
        out["flips"] = {**out["flips"], "meaning_judged_by": OLD_CLASSIFIER}
    _migrate_attribution(out)
    return out  # type: ignore[return-value]


def _flips_before_2_1(doc: dict) -> bool:
    """The report's flips section was written before 2.1: it has no meaning_judged_by (2.1
    writes the field always, null when no judge ran)."""
    flips = doc.get("flips")
    return isinstance(flips, dict) and "meaning_judged_by" not in flips


def _load(path: Path, what: str) -> dict:
    if not os.path.lexists(path):
        raise LogitdiffError(f"{path}: not found (is {path.parent} a logitdiff {what}?)")
    # a regular file (a FIFO or /dev/zero in its place is refused, not read until memory runs out)
    return read_input_json(path)


def _load_checked(path: str | Path, file: str, what: str, kind: str, schema: str,
                  migrate: Callable[[Any, Path], Any] | None = None) -> dict:
    """``file`` in directory ``path`` (or ``path`` itself): parsed, its kind and major version
    checked (by ``migrate``, which also turns an older MAJOR into the current one, where
    given), and with validation on every field against the ``schema`` JSON Schema."""
    path = Path(path)
    # A directory, or -- for a moment while another command swaps a directory into place --
    # a path that names nothing and no .json file: read as the directory it names.
    if path.is_dir() or (path.suffix != ".json" and not os.path.lexists(path)):
        path = path / file
    doc = _load(path, what)
    if migrate is not None:
        doc = migrate(doc, path)
    else:
        _accepts(doc, kind, path)
    if validation_on():
        validate(doc, schema, str(path))
    return doc


def load_report(path: str | Path) -> Report:
    """report.json (a REPORT directory or the file itself), checked: its kind and major
    version, a 1.x report migrated to 2.0 (:func:`migrate_report`), and with validation on
    (``LOGITDIFF_VALIDATE_OUTPUTS``, tests) every field."""
    return _load_checked(path, "report.json", "REPORT directory", REPORT_SCHEMA, "report",  # type: ignore[return-value]
                         migrate=migrate_report)


def load_summary(path: str | Path) -> RunSummary:
    """summary.json of a `logitdiff run` output (the directory or the file)."""
    return _load_checked(path, "summary.json", "`logitdiff run` output directory", RUN_SUMMARY_SCHEMA, "summary")  # type: ignore[return-value]
