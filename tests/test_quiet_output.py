"""Output a user reads when stderr is piped: no third-party progress bars (transformers'
GGUF de-quantizing bar drew thousands of characters a line, three times per hf:FILE.gguf run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

from _models import make_random_llama  # noqa: E402


def test_an_hf_gguf_capture_piped_draws_no_foreign_progress_bar(tmp_path):
    from logitdiff.sources.gguf_export import export_gguf

    base = make_random_llama(tmp_path / "m", hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, dtype="float32")
    gguf = export_gguf(base, tmp_path / "m-F32.gguf", "F32")
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 3}) + "\n")
    p = subprocess.run([sys.executable, "-m", "logitdiff.cli", "capture", f"hf:{gguf}", "--workload", str(work),
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "de-quantizing" not in p.stderr and "it/s]" not in p.stderr, p.stderr[-2000:]
    assert max((len(line) for line in p.stderr.splitlines()), default=0) < 400
    # the control: the same load with tqdm left on draws the bar (so the check above can fail)
    code = ("import os; os.environ.pop('TQDM_DISABLE', None)\n"
            "from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, gguf_file={gguf.name!r})\n")
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "de-quantizing" in q.stderr, q.stderr[-2000:]


def test_messages_piped_are_one_line_each(capsys):
    """stderr not a terminal: a stage or gate line longer than 80 columns stays one line (rich
    wrapped it at 80, splitting "gate not evaluated: ...: the report has no / flips section")."""
    from logitdiff.cli.console import console

    line = "gate not evaluated: Qwen3-30B-A3B-Instruct-2507-UD-Q4_K_XL: require tool_call_malformed<=0: the report has no flips section"
    console().print(line, highlight=False)
    assert capsys.readouterr().err == line + "\n"
