"""Capture and `run` on real models: transformers reference, llama.cpp candidates."""

import json
import subprocess
import sys

import numpy as np
import pytest
torch = pytest.importorskip("torch")

from _models import make_random_llama
from logitdiff.capture import LiveRun, capture_candidate, capture_reference, select_positions
from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.sources import Block, open_source
from logitdiff.store import RunReader
from logitdiff.workload import read_workload


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("cap")
    d = make_random_llama(root / "m", layers=2, dtype="float32")
    from logitdiff.sources.quantize import build_ladder

    ladder = build_ladder(d, root / "cache", ["Q8_0", "Q2_K"])
    wl = root / "wl.jsonl"
    rows = []
    for i in range(5):
        rows.append({"id": f"code{i}", "prompt": f"def f{i}(x):\n    return x +", "tags": ["code"], "max_tokens": 10})
        rows.append({"id": f"chat{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "tags": ["math"],
                     "expected": {"answer": str(2 * i)}, "max_tokens": 6})
    wl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"dir": d, "ladder": ladder, "wl": wl, "root": root}


@pytest.fixture(scope="module")
def ref_run(model):
    src = open_source(f"hf:{model['dir']},dtype=float32")
    return RunReader(capture_reference(src, read_workload(model["wl"]), model["root"] / "ref"))


def test_reference_capture_is_greedy_and_self_consistent(model, ref_run):
    items = ref_run.items()
    assert len(items) == 10 and ref_run.manifest["status"] == "complete"
    assert ref_run.dtype == "float32"
    for it in items:
        lg = ref_run.logits(it)
        # The teacher token is the argmax of the reference's own distribution (float32, no ties).
        np.testing.assert_array_equal(lg.argmax(1), it.next_tokens)
        assert it.extra["item"]["id"] == it.id
    assert len(ref_run.vocab()) == ref_run.vocab_size


def test_rerun_noise_floor_is_exactly_zero(model, ref_run):
    src = open_source(f"hf:{model['dir']},dtype=float32")
    comp = compare_runs(ref_run, LiveRun(src, ref_run))
    assert np.all(comp.columns["kl_nats"] == 0.0)
    assert comp.columns["top1_match"].all()


def test_cross_engine_f32(model, ref_run):
    """transformers F32 vs llama.cpp F32 GGUF of the same weights."""
    src = open_source(f"gguf:{model['ladder']['F32']}")
    comp = compare_runs(ref_run, LiveRun(src, ref_run))
    assert comp.columns["kl_nats"].mean() <= 1e-4
    assert comp.columns["top1_match"].mean() >= 0.995


def test_ladder_ordering_and_stored_equals_live(model, ref_run):
    means = {}
    for q in ("BF16", "Q8_0", "Q2_K"):
        src = open_source(f"gguf:{model['ladder'][q]}")
        means[q] = compare_runs(ref_run, LiveRun(src, ref_run)).columns["kl_nats"].mean()
    assert means["BF16"] < means["Q8_0"] < means["Q2_K"]
    # A stored candidate capture gives the same numbers as live scoring.
    src = open_source(f"gguf:{model['ladder']['Q2_K']}")
    stored = capture_candidate(src, ref_run, model["root"] / "q2")
    comp = compare_runs(ref_run, RunReader(stored))
    assert comp.columns["kl_nats"].mean() == pytest.approx(means["Q2_K"], rel=1e-12)


def test_topk_store(model, ref_run):
    src = open_source(f"gguf:{model['ladder']['Q8_0']}")
    run = RunReader(capture_candidate(src, ref_run, model["root"] / "q8top", store="topk:16"))
    assert run.kind.k == 16
    tk = run.topk(run.items()[0])
    assert tk["ids"].shape[1] == 16 and np.all(tk["tail_mass"] >= 0) and np.all(np.diff(tk["logprobs"], axis=1) <= 0)
    comp = compare_runs(ref_run, run)
    assert comp.kind == "top_k" and comp.method["top_logprobs"] == 16
    assert np.all(comp.columns["kl_nats"] >= 0)


def test_positions_modes():
    assert select_positions(5, "all", "a") == [0, 1, 2, 3, 4]
    assert select_positions(5, "first", "a") == [0]
    s = select_positions(100, "sample:0.1", "item-x")
    assert len(s) == 10 and s == sorted(s) and s == select_positions(100, "sample:0.1", "item-x")
    with pytest.raises(LogitdiffError, match="FRAC"):
        select_positions(5, "sample:2", "a")
    with pytest.raises(LogitdiffError, match="positions"):
        select_positions(5, "every", "a")


def test_tokenizer_mismatch_is_refused(model, ref_run, tmp_path):
    other = make_random_llama(tmp_path / "other", layers=1, vocab_size=400, dtype="float32")
    src = open_source(f"hf:{other}")
    with pytest.raises(LogitdiffError, match="vocab size|tokenizer"):
        LiveRun(src, ref_run)


def test_tokenization_difference_names_item_and_position(model, ref_run, tmp_path):
    """Same vocabulary, different chat template: caught item by item before scoring."""
    import shutil

    d = tmp_path / "tmpl"
    shutil.copytree(model["dir"], d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>assistant\n")
    src = open_source(f"hf:{d}")
    with pytest.raises(LogitdiffError, match=r"item 'chat0': tokenization differs at prompt position \d+"):
        LiveRun(src, ref_run)


DEPRECATION_LINE = "logitdiff: --teacher is deprecated, use --reference (accepted until 0.3)"


def test_capture_takes_the_old_flag_with_one_stderr_line(model, ref_run, tmp_path, capsys):
    """`capture --teacher RUN` (the old name of --reference) captures the same candidate and
    says so in exactly one stderr line (no Python warning on top); both flags: one error line."""
    import warnings

    spec = f"hf:{model['dir']},dtype=float32"
    assert main(["capture", spec, "--reference", str(ref_run.path), "--out", str(tmp_path / "new")]) == 0
    assert "deprecated" not in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["capture", spec, "--teacher", str(ref_run.path), "--out", str(tmp_path / "old")]) == 0
    assert not [w for w in caught if "teacher" in str(w.message)]
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "deprecated" in line] == [DEPRECATION_LINE]
    old, new = RunReader(tmp_path / "old"), RunReader(tmp_path / "new")
    assert [(it.id, it.teacher_ids, it.positions) for it in old.items()] == [(it.id, it.teacher_ids, it.positions) for it in new.items()]
    for a, b in zip(old.items(), new.items()):
        np.testing.assert_array_equal(old.logits(a), new.logits(b))
    assert main(["capture", spec, "--teacher", str(ref_run.path), "--reference", str(ref_run.path), "--out", str(tmp_path / "both")]) == 2
    err = capsys.readouterr().err
    assert err == ("logitdiff: error: --teacher and --reference both given: --teacher is the deprecated name of --reference "
                   "(accepted until 0.3); give --reference only\n")
    assert not (tmp_path / "both").exists()


def test_capture_and_run_help_say_what_reference_takes(capsys):
    """capture --reference takes a RUN (--teacher is not listed); run --reference a source spec."""
    for argv, want in ((["capture", "--help"], "--reference RUN"), (["run", "--help"], "--reference SPEC")):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert want in out and "--teacher RUN" not in out
    assert "a source, not a RUN" in out


def test_cli_capture_compare_live_and_run(model, ref_run, tmp_path, capsys):
    f32 = model["ladder"]["F32"]
    assert main(["capture", f"gguf:{f32}", "--reference", str(ref_run.path), "--out", str(tmp_path / "cand")]) == 0
    assert main(["compare", str(ref_run.path), str(tmp_path / "cand"), "--out", str(tmp_path / "rep1"), "--bootstrap", "20"]) == 0
    assert main(["compare", str(ref_run.path), f"gguf:{f32}", "--out", str(tmp_path / "rep2"), "--bootstrap", "20"]) == 0
    a = json.loads((tmp_path / "rep1" / "report.json").read_text())["summary"]
    b = json.loads((tmp_path / "rep2" / "report.json").read_text())["summary"]
    assert a["kl_nats_mean"] == pytest.approx(b["kl_nats_mean"], rel=1e-12)
    out = tmp_path / "runout"
    assert main(["run", "--reference", f"hf:{model['dir']},dtype=float32", "--candidate", f"gguf:{model['ladder']['Q8_0']}",
                 "--candidate", f"gguf:{model['ladder']['Q2_K']}", "--workload", str(model["wl"]), "--out", str(out), "--bootstrap", "50", "--floor", "none"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["noise_floor"]["kl_nats_mean"] == 0.0
    names = [c["name"] for c in summary["candidates"]]
    assert names == ["m-Q8_0", "m-Q2_K"]
    assert summary["candidates"][0]["kl_mean"] < summary["candidates"][1]["kl_mean"]
    for n in names:
        assert (out / "reports" / n / "report.json").exists()
    assert "noise floor" in (out / "summary.md").read_text()
    # A second run reuses the matching reference capture.
    capsys.readouterr()
    assert main(["run", "--reference", f"hf:{model['dir']},dtype=float32", "--candidate", f"gguf:{model['ladder']['Q8_0']}",
                 "--workload", str(model["wl"]), "--out", str(out), "--bootstrap", "10", "--no-noise-floor"]) == 0
    assert "reusing" in capsys.readouterr().err


def test_killed_capture_resumes(model, tmp_path):
    """A real capture process killed mid-way; --resume completes it, nothing lost or duplicated."""
    out = tmp_path / "ref"
    code = (
        "import os, sys\n"
        # the same torch thread count as this process: float32 sums differ with it
        f"import torch; torch.set_num_threads({torch.get_num_threads()})\n"
        "from logitdiff import capture\n"
        "from logitdiff.store import RunWriter\n"
        "orig = RunWriter.flush\n"
        "n = [0]\n"
        "def flush(self, wait=True):\n"
        "    orig(self, wait=True)\n"
        "    n[0] += 1\n"
        "    if n[0] == 2: os.kill(os.getpid(), 9)\n"
        "RunWriter.flush = flush\n"
        "orig_init = RunWriter.__init__\n"
        "def init(self, *a, **k):\n"
        "    k['chunk_rows'] = 1\n"
        "    orig_init(self, *a, **k)\n"
        "RunWriter.__init__ = init\n"
        "from logitdiff.cli import main\n"
        f"main(['capture', 'hf:{model['dir']},dtype=float32', '--workload', '{model['wl']}', '--out', '{out}'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = RunReader(out, allow_partial=True)
    # the writer flushes by rows, also in the middle of an item: some items, not all, are on disk
    assert partial.is_partial and 1 <= len(partial.items()) < len(read_workload(model["wl"]))
    assert main(["capture", f"hf:{model['dir']},dtype=float32", "--workload", str(model["wl"]), "--out", str(out)]) == 2
    assert main(["capture", f"hf:{model['dir']},dtype=float32", "--workload", str(model["wl"]), "--out", str(out), "--resume"]) == 0
    done = RunReader(out)
    assert [it.id for it in done.items()] == [r.id for r in read_workload(model["wl"])]
    fresh = RunReader(capture_reference(open_source(f"hf:{model['dir']},dtype=float32"), read_workload(model["wl"]), tmp_path / "fresh"))
    for a, b in zip(done.items(), fresh.items()):
        assert a.teacher_ids == b.teacher_ids
        np.testing.assert_array_equal(done.logits(a), fresh.logits(b))


def test_bad_specs(capsys, tmp_path):
    for spec, needle in [("nonsense", "KIND:TARGET"), ("foo:bar", "unknown kind"), (f"hf:{tmp_path}/missing", "not found"),
                         (f"gguf:{tmp_path}/missing.gguf", "not found"), ("builtin:huge", "unknown builtin")]:
        assert main(["capture", spec, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_too_long_prompt_fails_before_anything_is_written(model, tmp_path, capsys):
    wl = tmp_path / "long.jsonl"
    wl.write_text(json.dumps({"id": "ok", "prompt": "def f(x):"}) + "\n"
                  + json.dumps({"id": "huge", "prompt": "x = 1 + 2 * 3\n" * 2000}) + "\n")
    out = tmp_path / "run"
    assert main(["capture", f"hf:{model['dir']},dtype=float32", "--workload", str(wl), "--out", str(out)]) == 2
    # (transformers, imported earlier in this test process, may print its loading bar first)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "item 'huge'" in errors[0] and "max_position_embeddings" in errors[0], errors
    assert not out.exists()


def test_device_blocks_are_handed_out_in_order_once_arrived():
    """The CUDA pipeline of HFSource (one block in flight): block i is handed out after
    block i+1 was launched, once its own copy has arrived (its event waited on), in pair and
    position order; bf16 rows and 16-bit hidden bits come out as uint16 bits. (Driven with
    host tensors and stand-in events, so it runs without a GPU; the launch itself is
    exercised by bench/gpu_check.sh on a GPU.)"""
    from logitdiff.sources.hf import HFSource

    launched, waited = [], []

    class Event:
        def __init__(self, i):
            self.i = i

        def synchronize(self):
            waited.append(self.i)

    rows = [torch.full((2, 5), float(i), dtype=torch.bfloat16) for i in range(4)]
    hid = [torch.full((2, 3), float(-i), dtype=torch.float16).view(torch.int16) for i in range(4)]

    def launches():
        for i in range(4):
            launched.append(i)
            yield (7, 2 * i, rows[i], hid[i]), Event(i)

    seen = []
    for b in HFSource._landed(launches()):
        seen.append(b.t0 // 2)
        assert waited[-1] == b.t0 // 2  # its copy waited on before it is used
        assert launched[-1] == min(3, b.t0 // 2 + 1)  # the next block already launched
        assert b.pair == 7 and b.rows.dtype == np.uint16 and b.hidden.dtype == np.uint16
        np.testing.assert_array_equal(b.rows, rows[b.t0 // 2].view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(b.hidden.view(np.float16), np.float16(-(b.t0 // 2)))
    assert seen == [0, 1, 2, 3] and waited == [0, 1, 2, 3]
    # the CPU path: finished blocks (no event) pass straight through
    cpu = [b.t0 for b in HFSource._landed(iter([(Block(0, 0, np.zeros((1, 2))), None), (Block(0, 1, np.zeros((1, 2))), None)]))]
    assert cpu == [0, 1]
