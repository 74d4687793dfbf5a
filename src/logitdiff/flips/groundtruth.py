"""A benchmark's own ground truth graded through the path a model's answers take
(``logitdiff workloads check NAME``): a grader that fails its ground truth is a bug."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import LogitdiffError
from ..workload.benchmarks import BENCHMARKS, parse_benchmark
from .grading import grade


@dataclass
class GroundTruthCheck:
    n_items: int
    failed: list[tuple[str, str]]  # (item id, the grader's one line)
    # items no answer can pass by the benchmark's own data (Benchmark.unpassable), each graded
    # and rejected as claimed: (item id, why none can pass)
    unpassable: list[tuple[str, str]] = field(default_factory=list)


def check_ground_truth(text: str, progress: Callable[[], None] | None = None,
                       tool_form: str | None = None) -> GroundTruthCheck:
    """Grade ``NAME[:N]``'s ground truth through the grader a model's answers take
    (flips.grading.grade): every item must pass, but those the benchmark's own data leaves no
    passing answer for (``Benchmark.unpassable``), which must be rejected. ``tool_form``
    (a benchmark with ``tool_forms``): the items in that form (ToolForm), the ground truth
    written in its output syntax."""
    parsed = parse_benchmark(text)
    if parsed is None:
        raise LogitdiffError(f"{text}: not a benchmark (one of {', '.join(BENCHMARKS)})")
    bench, count = parsed
    items = bench.load()[:count] if count is not None else bench.load()
    if tool_form is None:
        truth = bench.ground_truth()
    elif tool_form not in bench.tool_forms or bench.in_tool_form is None or bench.ground_truth_in is None:
        raise LogitdiffError(f"{text}: no tool form {tool_form!r} (its forms: {', '.join(bench.tool_forms) or 'none'})")
    else:
        items = [bench.in_tool_form(item, tool_form) for item in items]
        truth = bench.ground_truth_in(tool_form)
    unpassable = bench.unpassable() if bench.unpassable else {}
    failed, rejected = [], []
    for item in items:
        g = grade(item.expected or {}, truth[item.id], item.tools, where=f"{bench.name} item {item.id!r}", prompt=item.prompt or "")
        if item.id in unpassable:
            if g.correct:  # the claim that none can pass is wrong
                failed.append((item.id, f"passes, though taken for one no answer can pass ({unpassable[item.id]})"))
            else:
                rejected.append((item.id, unpassable[item.id]))
        elif not g.correct:
            failed.append((item.id, g.detail))
        if progress:
            progress()
    return GroundTruthCheck(len(items), failed, rejected)
