"""``--workload text:FILE``: a plain text scored in llama-perplexity's chunks, no generation.

Real llama.cpp models (a random Llama from tests/_models.py exported to GGUF, and a copy of it
that adds BOS); the chunk rows are checked against an independent recomputation: the text
tokenized and every chunk evaluated by ``llama_cpp.Llama`` directly (``logits_all``), the rows
at positions n_ctx/2 .. n_ctx-2 taken by index. The slow test compares the mean KL with
``llama-perplexity --kl-divergence`` itself when that binary is built (scripts/build_llama_server.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from _models import make_random_llama, rewrite_gguf  # noqa: E402

from logitdiff.cli import main  # noqa: E402
from logitdiff.store import RunReader  # noqa: E402
from logitdiff.workload.text import perplexity_chunks  # noqa: E402

THREADS = 2
CTX = 64
WORDS = ("the model reads a long text and predicts every next token; numbers 12 + 30 = 42, code def f(x): "
         "return x * 2, and prose about rivers, mountains, weather and the sea. ")


def _text(n_repeats: int) -> str:
    rng = np.random.default_rng(0)
    words = WORDS.split()
    return " ".join(words[i] for i in rng.integers(0, len(words), 40 * n_repeats)) + "\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from logitdiff.sources.gguf_export import export_gguf
    from logitdiff.sources.quantize import quantize

    d = tmp_path_factory.mktemp("text")
    hf = make_random_llama(d / "llama")
    f32 = export_gguf(hf, d / "m-F32.gguf", "F32")
    q8 = quantize(f32, d / "m-Q8_0.gguf", "Q8_0")
    bos = rewrite_gguf(f32, d / "m-bos-F32.gguf", fields={"tokenizer.ggml.add_bos_token": True,
                                                           "tokenizer.ggml.bos_token_id": 1})
    text = d / "text.txt"
    text.write_text(_text(6), encoding="utf-8")
    return {"f32": Path(f32), "q8": Path(q8), "bos": bos, "text": text, "dir": d}


def _direct_rows(path: Path, text: str, n_ctx: int, max_chunks: int | None = None):
    """Independent recomputation: llama_cpp.Llama with logits_all, each chunk evaluated alone."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=THREADS, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        add_bos = llm._model.add_bos_token()
        n_chunk = len(ids) // n_ctx if max_chunks is None else min(len(ids) // n_ctx, max_chunks)
        out = []
        for c in range(n_chunk):
            chunk = list(ids[c * n_ctx : (c + 1) * n_ctx])
            if add_bos:
                chunk[0] = llm.token_bos()
            llm.reset()
            llm.eval(chunk)
            first = n_ctx // 2
            out.append((chunk, np.array(llm.scores[first : n_ctx - 1], dtype=np.float32)))
        return ids, bool(add_bos), out
    finally:
        llm.close()


@pytest.mark.parametrize("which", ["f32", "bos"])
def test_text_capture_rows_are_llama_perplexity_chunks(models, tmp_path, which):
    """Items, teacher tokens and every stored row equal the independent recomputation (token 0
    of each chunk is BOS where the model adds one; rows within the float noise of two batch
    layouts of the same llama.cpp, which here are the same layout: equal to 1e-4)."""
    run = tmp_path / "ref"
    assert main(["capture", f"gguf:{models[which]},threads={THREADS}", "--workload", f"text:{models['text']}",
                 "--ctx", str(CTX), "--out", str(run)]) == 0
    r = RunReader(run)
    ids, add_bos, direct = _direct_rows(models[which], models["text"].read_text(encoding="utf-8"), CTX)
    assert add_bos == (which == "bos")
    assert len(ids) >= 3 * CTX  # the text spans several chunks and a dropped tail
    items = r.items()
    assert len(items) == len(ids) // CTX == len(direct)
    settings = r.manifest["settings"]["text"]
    assert settings["n_ctx"] == CTX and settings["chunks"] == len(items) and settings["tokens"] == len(ids)
    first = CTX // 2
    for it, (chunk, rows) in zip(items, direct):
        assert it.prompt_ids == chunk[: first + 1]
        assert it.teacher_ids == chunk[first + 1 :]
        assert it.positions == list(range(CTX - 1 - first))
        got = np.asarray(r.logits(it), dtype=np.float32)
        assert got.shape == rows.shape == (CTX - 1 - first, r.vocab_size)
        np.testing.assert_allclose(got, rows, atol=1e-4, rtol=0)


def test_chunk_rule_against_index_arithmetic():
    """perplexity_chunks against a direct index computation, over sizes around the chunk
    boundaries, odd and even n_ctx, with and without BOS and --chunks."""
    for n_ctx in (4, 5, 8, 9):
        for n in (2 * n_ctx, 2 * n_ctx + 1, 3 * n_ctx - 1, 3 * n_ctx, 5 * n_ctx + 3):
            ids = list(range(100, 100 + n))
            for bos in (None, 7):
                for cap in (None, 1, 2, 100):
                    got = perplexity_chunks(ids, n_ctx, bos, max_chunks=cap)
                    n_chunk = n // n_ctx if cap is None else min(n // n_ctx, cap)
                    assert len(got) == n_chunk
                    first = n_ctx // 2
                    for c, ch in enumerate(got):
                        base = c * n_ctx
                        assert ch.prompt_ids == [bos if (bos is not None) else 100 + base] + [100 + base + j for j in range(1, first + 1)]
                        assert ch.teacher_ids == [100 + base + j for j in range(first + 1, n_ctx)]
                        assert len(ch.teacher_ids) == n_ctx - 1 - first  # llama-perplexity's scored count


def test_text_too_short_and_bad_arguments(models, tmp_path, capsys):
    """Under two chunks, a bad --ctx/--chunks, --ctx without a text, a missing or non-UTF-8
    file: one line naming the file or flag, exit 2, no RUN written."""
    short = tmp_path / "short.txt"
    short.write_text("a few words only", encoding="utf-8")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff\xfe")
    spec = f"gguf:{models['f32']},threads={THREADS}"
    cases = [
        (["--workload", f"text:{short}", "--ctx", str(CTX)], r"short\.txt .*tokenizes to \d+ tokens; a context of 64 needs at least 128"),
        (["--workload", f"text:{models['text']}", "--ctx", "2"], r"--ctx 2: must be at least 4"),
        (["--workload", f"text:{models['text']}", "--chunks", "0"], r"--chunks 0: must be at least 1"),
        (["--ctx", "64"], r"--ctx and --chunks cut a text: workload"),
        (["--workload", f"text:{tmp_path / 'none.txt'}"], r"none\.txt: text file not found"),
        (["--workload", f"text:{binary}"], r"bin\.txt: not valid UTF-8 \(byte 0xff at offset 3\)"),
        (["--workload", f"text:{models['text']}", "--max-tokens", "5"], r"--max-tokens: not available with a text: workload"),
    ]
    for k, (args, pattern) in enumerate(cases):
        out = tmp_path / f"run{k}"
        assert main(["capture", spec, *args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(pattern, err), (args, err)
        assert not out.exists() or not any(out.iterdir()), args


def test_text_candidate_live_compare_equals_stored(models, tmp_path):
    """A candidate scored live in compare and one captured then compared give the same
    per-position KL: the text's items need nothing from a workload file."""
    import json

    ref = tmp_path / "ref"
    assert main(["capture", f"gguf:{models['f32']},threads={THREADS}", "--workload", f"text:{models['text']}",
                 "--ctx", str(CTX), "--chunks", "2", "--out", str(ref)]) == 0
    cand = tmp_path / "cand"
    spec = f"gguf:{models['q8']},threads={THREADS}"
    assert main(["capture", spec, "--reference", str(ref), "--out", str(cand)]) == 0
    assert main(["compare", str(ref), str(cand), "--out", str(tmp_path / "a"), "--bootstrap", "0"]) == 0
    assert main(["compare", str(ref), spec, "--out", str(tmp_path / "b"), "--bootstrap", "0"]) == 0
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    ka = [row["kl_nats"] for row in a["rows"]]
    kb = [row["kl_nats"] for row in b["rows"]]
    assert len(ka) == 2 * (CTX - 1 - CTX // 2)
    assert ka == kb and 0 < float(np.mean(ka)) < 1
    # the report's per-position KL is the torch-free kernel path's; the torch path (what
    # compare ran before it) gives the same to 1e-12 per position (tests/test_metrics.py says why)
    import torch

    from logitdiff.numerics.metrics import full_vocab

    r, c = RunReader(ref), RunReader(cand)
    zr = np.concatenate([np.asarray(r.logits(it), np.float32) for it in r.items()])
    zc = np.concatenate([np.asarray(c.logits(it), np.float32) for it in c.items()])
    y = np.concatenate([it.next_tokens for it in r.items()])
    new = full_vocab(zr, zc, y, k=10)["kl_nats"]
    old = full_vocab(torch.from_numpy(zr), torch.from_numpy(zc), y, k=10)["kl_nats"]
    np.testing.assert_allclose(new, ka, rtol=0, atol=1e-15)
    np.testing.assert_allclose(new, old, rtol=0, atol=1e-12)
    assert abs(new.mean() - old.mean()) <= 1e-12


def test_small_blocks_several_per_decode_live_equals_stored_and_direct(models, tmp_path):
    """With a chunk of 5 rows, a chunk's 31 scored rows come from decodes that flag up to
    FORWARD_CHUNKS blocks of output rows (two decode windows: 20 + 11 rows), each copied out
    in blocks of 5 from pooled buffers, and the live candidate's blocks are made on a worker
    thread ahead of the metrics (and, on one thread, without) and paired with the
    reference's pieces without concatenation. Every live compare equals the stored
    candidate's compare exactly (same chunk size: the same decodes), and the stored rows
    equal the independent evaluation of each chunk in one decode within the float noise of
    two batch layouts (1e-4)."""
    from logitdiff.capture import LiveRun, capture_candidate
    from logitdiff.compare import compare_runs
    from logitdiff.sources.registry import open_source
    from logitdiff.store import FORWARD_CHUNKS

    ref = tmp_path / "ref"
    assert main(["capture", f"gguf:{models['f32']},threads={THREADS}", "--workload", f"text:{models['text']}",
                 "--ctx", str(CTX), "--chunks", "3", "--out", str(ref)]) == 0
    r = RunReader(ref)
    assert (CTX - 1 - CTX // 2) > 5 * FORWARD_CHUNKS  # the case: more rows than one decode window
    with open_source(f"gguf:{models['q8']},threads={THREADS}") as src:
        chunk = 5 * src.vocab_size * 4
        capture_candidate(src, r, tmp_path / "cand", chunk_bytes=chunk)
        c = RunReader(tmp_path / "cand")
        stored = compare_runs(r, c, chunk_bytes=chunk)
        for overlap in (True, False):
            live_run = LiveRun(src, r, chunk_bytes=chunk)
            live_run.overlap = overlap
            live = compare_runs(r, live_run, chunk_bytes=chunk)
            assert live.n == stored.n == 3 * (CTX - 1 - CTX // 2)
            for key in ("kl_nats", "kl_rev_nats", "jsd_nats", "top1_cand", "entropy_cand", "p_cand_token"):
                assert np.array_equal(live.columns[key], stored.columns[key]), (overlap, key)
    _, _, direct = _direct_rows(models["q8"], models["text"].read_text(encoding="utf-8"), CTX, max_chunks=3)
    for it, (_, rows) in zip(c.items(), direct):
        np.testing.assert_allclose(np.asarray(c.logits(it), np.float32), rows, rtol=0, atol=1e-4)


def test_an_interrupted_live_compare_leaves_no_forward_pass_running(models, tmp_path):
    """Ctrl-C in the middle of a live compare (here raised by the progress callback, where a
    terminal's bar sees it): compare_runs closes the candidate's stream before the interrupt
    leaves it, so the worker that decodes ahead is joined then — not when the traceback is
    freed — and the model can be closed right after without a decode in flight."""
    import threading

    from logitdiff.capture import LiveRun
    from logitdiff.compare import compare_runs
    from logitdiff.sources.registry import open_source

    ref = tmp_path / "ref"
    assert main(["capture", f"gguf:{models['f32']},threads={THREADS}", "--workload", f"text:{models['text']}",
                 "--ctx", str(CTX), "--chunks", "3", "--out", str(ref)]) == 0
    r = RunReader(ref)
    seen = []

    def interrupt(n):
        seen.append(n)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with open_source(f"gguf:{models['q8']},threads={THREADS}") as src:
        live = LiveRun(src, r, chunk_bytes=5 * src.vocab_size * 4)
        live.overlap = True
        with pytest.raises(KeyboardInterrupt) as caught:
            compare_runs(r, live, chunk_bytes=5 * src.vocab_size * 4, progress=interrupt)
        assert not [t for t in threading.enumerate() if t.name.startswith("logitdiff-live:")]
        assert caught.value is not None  # the traceback is still held: the worker did not wait for it to go


def _llama_perplexity() -> Path | None:
    tools = Path(os.environ.get("LOGITDIFF_TOOLS", Path.home() / ".cache" / "logitdiff" / "tools"))
    p = tools / "llama-server" / "current" / "bin" / "llama-perplexity"
    return p if p.is_file() and os.access(p, os.X_OK) else None


@pytest.mark.slow
def test_mean_kl_matches_llama_perplexity(models, tmp_path):
    """logitdiff's mean KL on a text against llama-perplexity's printed "Mean KLD" on the same
    text, model pair, n_ctx and chunks. The two differ by llama.cpp's base file (each log p
    rounded to a 16-bit step of (max - min)/65535 <= 2.4e-4 nats, entries at or below
    max - 16 nats dropped from its sum) and by the float rounding of two batch layouts of the
    same engine; on this model pair that is under 1 % of the mean (tolerance: 2 % relative,
    plus 1e-4 absolute for the quantisation step)."""
    exe = _llama_perplexity()
    if exe is None:
        pytest.skip("llama-perplexity not built (bash scripts/build_llama_server.sh builds it)")
    base = tmp_path / "base.kld"
    text = models["text"]
    common = ["-c", str(CTX), "-b", str(CTX), "-t", str(THREADS), "-f", str(text)]
    subprocess.run([str(exe), "-m", str(models["f32"]), "--kl-divergence-base", str(base), *common],
                   check=True, capture_output=True, text=True)
    # llama.cpp logs from a worker thread; on a loaded machine its last lines are sometimes lost
    # at exit (seen here: the output cut after "Cor(ln(PPL(Q)), ...)"), so the pass is rerun
    # (deterministic: same figure) up to three times
    for _ in range(3):
        res = subprocess.run([str(exe), "-m", str(models["q8"]), "--kl-divergence-base", str(base), "--kl-divergence",
                              *common], check=True, capture_output=True, text=True)
        m = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", res.stdout + res.stderr)
        if m:
            break
    assert m, (res.stdout + res.stderr)[-2000:]
    theirs = float(m.group(1))
    ref = tmp_path / "ref"
    assert main(["capture", f"gguf:{models['f32']},threads={THREADS}", "--workload", f"text:{text}", "--ctx", str(CTX),
                 "--out", str(ref)]) == 0
    assert main(["compare", str(ref), f"gguf:{models['q8']},threads={THREADS}", "--out", str(tmp_path / "rep"),
                 "--bootstrap", "0"]) == 0
    import json

    ours = json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]["kl_nats_mean"]
    print(f"\nmean KL: logitdiff {ours:.6f}, llama-perplexity 'Mean KLD' {theirs:.6f}, "
          f"relative difference {abs(ours - theirs) / theirs:.3%}")
    assert abs(ours - theirs) <= 0.02 * theirs + 1e-4, (ours, theirs)
