"""``logitdiff workloads``: validate lists every bad record (one line each, naming the line,
the item and the field), the JSON Schema agrees with the reader, and bundled workloads are
found by name."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from logitdiff.builtin import WORKLOAD
from logitdiff.errors import LogitdiffError
from logitdiff.workload import read_workload
from logitdiff.workload.validate import validate_workload, workload_schema

GOOD = {"id": "g", "prompt": "2 + 2 =", "tags": ["math"], "max_tokens": 4, "expected": {"numeric": 4}}

# (record, the field its error must name): one bad field per record, every field the reader checks
BAD = [
    ({"prompt": "x"}, "id"),
    ({"id": "", "prompt": "x"}, "id"),
    ({"id": "x"}, "prompt"),
    ({"id": "x", "prompt": "p", "messages": [{"role": "user", "content": "m"}]}, "prompt"),
    ({"id": "x", "prompt": 3}, "prompt"),
    ({"id": "x", "messages": []}, "messages"),
    ({"id": "x", "messages": [{"content": "no role"}]}, "messages"),
    ({"id": "x", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"id": "x", "prompt": "p", "tags": "code"}, "tags"),
    ({"id": "x", "prompt": "p", "tags": [1]}, "tags"),
    ({"id": "x", "prompt": "p", "max_tokens": 0}, "max_tokens"),
    ({"id": "x", "prompt": "p", "max_tokens": 2.5}, "max_tokens"),
    ({"id": "x", "prompt": "p", "max_tokens": True}, "max_tokens"),
    ({"id": "x", "prompt": "p", "expected": "42"}, "expected"),
    ({"id": "x", "prompt": "p", "expected": {}}, "expected"),
    ({"id": "x", "prompt": "p", "expected": {"answer": "1", "regex": "1"}}, "expected"),
    ({"id": "x", "prompt": "p", "expected": {"numeric": "4"}}, "expected.numeric"),
    ({"id": "x", "prompt": "p", "expected": {"tool_call": {"arguments": {}}}}, "expected.tool_call"),
    ({"id": "x", "prompt": "p", "tools": {"name": "f"}}, "tools"),
    ({"id": "x", "prompt": "p", "tools": [{"type": "function"}]}, "tools[0]"),
    ({"id": "x", "prompt": "p", "tools_module": ""}, "tools_module"),
]


def _write(tmp_path, records, name="w.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


@pytest.mark.parametrize("record,field", BAD, ids=[f"{f}-{k}" for k, (_, f) in enumerate(BAD)])
def test_validate_names_the_line_the_item_and_the_field(tmp_path, record, field):
    # the bad record between two good ones: exactly one error, on its line, naming its field
    p = _write(tmp_path, [GOOD, record, {**GOOD, "id": "g2"}])
    check = validate_workload(p)
    assert len(check.errors) == 1 and len(check.items) == 2, check.errors
    line = check.errors[0]
    assert line.startswith(f"{p}:2") and "\n" not in line
    assert f"'{field}'" in line or f"{field}" in line.split(":", 2)[2], line
    if isinstance(record.get("id"), str) and record["id"]:
        assert f"(id {record['id']!r})" in line
    # the reader stops at the same line with the same message
    with pytest.raises(LogitdiffError) as e:
        read_workload(p)
    assert str(e.value) == line


@pytest.mark.parametrize("record,field", BAD, ids=[f"{f}-{k}" for k, (_, f) in enumerate(BAD)])
def test_the_schema_refuses_what_the_reader_refuses(record, field):
    schema = workload_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, schema)


def test_the_schema_accepts_every_bundled_item():
    schema = workload_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    items = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    assert len(items) == len(read_workload(WORKLOAD)) > 0
    for d in items:
        jsonschema.validate(d, schema)


def test_every_bad_record_is_listed_and_duplicates_and_bad_json_too(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text("\n".join([json.dumps(GOOD), json.dumps(GOOD), "{not json", json.dumps(BAD[2][0]), ""]) + "\n")
    check = validate_workload(p)
    assert [e.split(":")[1].split(" ")[0] for e in check.errors] == ["2", "3", "4"]
    assert "duplicate item id 'g' (first on line 1)" in check.errors[0]
    assert "not valid JSON" in check.errors[1]


def test_a_misspelt_field_is_a_warning_naming_it(tmp_path):
    p = _write(tmp_path, [{**GOOD, "expect": {"answer": "4"}}])
    check = validate_workload(p)
    assert check.ok and len(check.warnings) == 1
    assert "field 'expect' is not a workload field" in check.warnings[0] and f"{p}:1 (id 'g')" in check.warnings[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "logitdiff.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_validate_exit_status_and_output(tmp_path):
    bad = _write(tmp_path, [GOOD, BAD[10][0], BAD[2][0]], "bad.jsonl")
    p = _cli("workloads", "validate", str(bad))
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "max_tokens" in errors[0] and "prompt" in errors[1]
    assert p.stdout == ""
    good = _write(tmp_path, [GOOD], "good.jsonl")
    p = _cli("workloads", "validate", str(good))
    assert p.returncode == 0 and "1 items valid; 1 labelled; tags: math 1" in p.stdout, p.stderr


def test_cli_validate_missing_file_is_one_line(tmp_path):
    p = _cli("workloads", "validate", str(tmp_path / "nope.jsonl"))
    assert p.returncode == 2 and p.stderr.strip() == f"logitdiff: error: {tmp_path / 'nope.jsonl'}: workload file not found"


def test_bundled_workload_by_name():
    assert len(read_workload("builtin")) == len(read_workload(WORKLOAD))
    p = _cli("workloads", "list")
    assert p.returncode == 0 and "builtin" in p.stdout and str(len(read_workload(WORKLOAD))) in p.stdout
    p = _cli("workloads", "schema")
    assert p.returncode == 0 and json.loads(p.stdout) == workload_schema()


def test_a_file_named_like_a_bundled_workload_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, [GOOD], "builtin")
    assert [i.id for i in read_workload("builtin")] == ["g"]


def test_run_help_shows_the_workload_format_and_a_readable_description():
    """`run --help` carries the workload format (cli.workloads.FORMAT) with its columns kept,
    and its own description wrapped to lines a terminal shows whole."""
    from logitdiff.cli import build_parser
    from logitdiff.cli.run import DESCRIPTION
    from logitdiff.cli.workloads import FORMAT

    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert FORMAT in text  # every line as written, the field names aligned
    head = text.split("options:")[0]
    desc = [ln for ln in head.splitlines() if ln and not ln.startswith(("usage:", " "))]
    assert " ".join(" ".join(desc).split()) == " ".join(DESCRIPTION.split())
    assert len(desc) >= 5 and max(map(len, desc)) <= 100, desc
    assert "Exit status:" in text and "Landlock" in text  # the gates' and the sandbox's epilog kept
