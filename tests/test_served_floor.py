"""The served noise floor and controlled batching on real llama-servers started here
(127.0.0.1, llama-server's default flags: -np auto = several slots on a unified KV cache,
--cache-idle-slots), serving the GGUF ladder of a random Llama.

* ``batching=serial`` scores one task per server batch: two captures of a quantized model
  with other item groupings are bit-identical;
* ``batching=rounds`` (the default) mixes items in the server's batches: the two captures
  differ, and ``logitdiff run`` measures that floor for both served sides and reads the
  candidate against it (report.json, report.md, summary.json);
* ``compare`` notes two sides captured in different modes.

A server that cannot start FAILS the test with its log tail (scripts/build_llama_server.sh).
"""

import json

import numpy as np
import pytest

from _models import make_random_llama
from servers import llama_server, start_or_fail
from logitdiff.capture import capture_candidate
from logitdiff.compare import compare_runs
from logitdiff.pipeline import RunConfig, run_pipeline
from logitdiff.sources import open_source
from logitdiff.store import RunReader
from logitdiff.workload import read_workload

K = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("servedfloor")
    d = make_random_llama(root / "m", layers=2, dtype="float32")
    from logitdiff.sources.quantize import build_ladder

    ladder = build_ladder(d, root / "cache", ["Q4_K_M"])
    wl = root / "wl.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"item {i}: the {'quick brown fox' if i % 2 else 'lazy dog'} number {i * 7}",
             "max_tokens": 6 + (i % 5)} for i in range(12)]
    wl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = root / "logs"
    ref_srv = start_or_fail(llama_server, ladder["F32"], logs, default_flags=True)
    cand_srv = start_or_fail(llama_server, ladder["Q4_K_M"], logs, default_flags=True)
    yield {"root": root, "wl": wl, "ref": ref_srv, "cand": cand_srv}
    ref_srv.stop()
    cand_srv.stop()


def _rows(run: RunReader):
    ids, lps = [], []
    for it in run.items():
        t = run.topk(it)
        ids.append(np.asarray(t["ids"]))
        lps.append(np.asarray(t["logprobs"]))
    return np.concatenate(ids), np.concatenate(lps)


def test_serial_batching_is_bit_identical_across_item_groupings(served, tmp_path):
    """Serial scoring of the Q4_K_M server: other batch layouts (other neighbours, other
    items cached before each one) give the same rows bit for bit; rounds do not have to."""
    spec = f"openai:{served['cand'].url},top_k={K},batching=serial"
    with open_source(f"openai:{served['ref'].url},top_k={K}") as src:
        from logitdiff.capture import capture_reference

        ref = RunReader(capture_reference(src, read_workload(served["wl"]), tmp_path / "ref"))
    with open_source(spec) as src:
        assert src.identity()["batching"] == "serial"
        a = RunReader(capture_candidate(src, ref, tmp_path / "a", batch=8))
        b = RunReader(capture_candidate(src, ref, tmp_path / "b", batch=3))
    assert a.manifest["source"]["identity"]["batching"] == "serial"
    ia, la = _rows(a)
    ib, lb = _rows(b)
    assert (ia == ib).all() and (la == lb).all()
    assert compare_runs(a, b).columns["kl_nats"].max() == 0.0
    # a rounds capture of the same server, compared with the serial one: the report says
    # which mode each side was captured in, and warns that they differ
    with open_source(f"openai:{served['cand'].url},top_k={K}") as src:
        assert src.identity()["batching"] == "rounds"
        r = RunReader(capture_candidate(src, ref, tmp_path / "r"))
    comp = compare_runs(a, r)
    assert comp.method["served_batching"] == {"reference": "serial", "candidate": "rounds"}
    assert any("different served batching modes" in n for n in comp.notes)
    assert not any("batching" in n for n in compare_runs(ref, r).notes)


def test_run_measures_the_served_floor_on_real_servers(served, tmp_path, capfd):
    """`logitdiff run` with a served reference and a served candidate (default rounds
    batching): each side is scored a second time with other batch mates; the report gives
    the candidate as a multiple of that floor, and the numbers are the ones measured."""
    out = tmp_path / "out"
    ref_spec = f"openai:{served['ref'].url},top_k={K}"
    cand_spec = f"openai:{served['cand'].url},top_k={K}"
    summary = run_pipeline(RunConfig(reference=ref_spec, candidates=[cand_spec], workload=str(served["wl"]), out=str(out),
                                     flips=False, correctness=False, html=False, bootstrap=20))
    row = summary["candidates"][0]
    rep = json.loads((out / "reports" / row["name"] / "report.json").read_text())
    s = rep["summary"]
    fl = s["served_floor"]
    assert fl["reference"]["spec"] == ref_spec and fl["candidate"]["spec"] == cand_spec
    assert fl["reference"]["batching"] == fl["candidate"]["batching"] == "rounds"
    assert "batch boundaries moved" in fl["reference"]["measured_by"]
    n = s["positions"]
    assert fl["reference"]["positions"] == fl["candidate"]["positions"] == n
    # the floor is the larger side's; the reference's is the run's noise floor
    assert fl["kl_nats_mean"] == max(fl["reference"]["kl_nats_mean"], fl["candidate"]["kl_nats_mean"])
    assert fl["reference"]["kl_nats_mean"] == pytest.approx(summary["noise_floor"]["kl_nats_mean"], rel=1e-12)
    # the quantized server's rows move with their batch mates (the reason for the floor)
    assert fl["candidate"]["kl_nats_mean"] > 0
    assert s["kl_mean_x_served_floor"] == pytest.approx(s["kl_nats_mean"] / fl["kl_nats_mean"], rel=1e-12)
    assert s["within_2x_served_floor"] == (s["kl_mean_x_served_floor"] <= 2)
    assert row["x_served_floor"] == s["kl_mean_x_served_floor"]
    assert rep["method"]["served_batching"] == {"reference": "rounds", "candidate": "rounds"}
    md = (out / "reports" / row["name"] / "report.md").read_text()
    assert "× served floor" in md and "served batching: reference `rounds`, candidate `rounds`" in md
    assert "× served floor" in (out / "summary.md").read_text()
    # and on the terminal of `logitdiff run`, beside the table
    from logitdiff.cli.run import print_run_summary

    capfd.readouterr()
    print_run_summary(summary)
    assert "× served floor" in "".join(capfd.readouterr())
    # the candidate's capture is kept as a RUN, and the comparison was made from it
    cand = RunReader(out / "runs" / f"candidate-{row['name']}")
    assert cand.manifest["status"] == "complete" and cand.manifest["source"]["identity"]["batching"] == "rounds"


def _topk_run(path, logits, teacher, identity):
    from scipy.special import log_softmax

    from logitdiff.store import RunItem, RunWriter

    V = logits.shape[1]
    w = RunWriter(path, source={"spec": identity.get("spec", "x"), "identity": identity}, vocab_size=V, tokenizer_hash="sha256:t",
                  store=f"topk:{K}", chunk_rows=16, vocab=[f"t{i}" for i in range(V)])
    it = RunItem(id="a", prompt_ids=[1, 2], teacher_ids=list(teacher), positions=list(range(len(teacher))))
    lp = log_softmax(logits.astype(np.float64), axis=1)
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :K]
    w.add(it, stored={"ids": ids, "logprobs": np.take_along_axis(lp, ids, 1)})
    w.finish()
    return RunReader(path)


def test_served_floor_fields_batching_notes_and_report(tmp_path):
    """The report side of the floor without servers: batching of each served side in
    method.served_batching (a served RUN from before the option reads as rounds), the note
    for two different modes, and summary fields that validate against the schema and read
    as the multiple of the floor in report.md; a floor of 0 (bit-identical captures) gives
    no multiple."""
    from logitdiff.report import build_report
    from logitdiff.report.markdown import render_markdown
    from logitdiff.sources.served_floor import floor_side, served_floor

    rng = np.random.default_rng(3)
    z = rng.normal(0, 3, (20, 64)).astype(np.float32)
    t = rng.integers(0, 64, 20)
    a = _topk_run(tmp_path / "a", z, t, {"kind": "openai", "spec": "openai:A", "batching": "serial"})
    b = _topk_run(tmp_path / "b", z + rng.normal(0, 0.1, z.shape).astype(np.float32), t, {"kind": "openai", "spec": "openai:B"})
    h = _topk_run(tmp_path / "h", z, t, {"kind": "hf", "spec": "hf:x"})
    comp = compare_runs(a, b)
    assert comp.method["served_batching"] == {"reference": "serial", "candidate": "rounds"}
    assert any("different served batching modes (reference serial, candidate rounds)" in n for n in comp.notes)
    assert compare_runs(h, b).method["served_batching"] == {"reference": None, "candidate": "rounds"}
    assert "served_batching" not in compare_runs(h, h).method
    self_floor = floor_side(compare_runs(b, b), spec="openai:B", batching="rounds", shift=4)
    assert self_floor["kl_nats_mean"] == 0.0 and self_floor["positions"] == 20
    noisy = floor_side(comp, spec="openai:B", batching="rounds", shift=4)
    for fl, want_x in ((served_floor(None, noisy), True), (served_floor(self_floor, None), False)):
        comp.served_floor = fl
        report, _ = build_report(comp, n_boot=5)  # validated against the schema (conftest)
        s = report["summary"]
        assert s["served_floor"]["kl_nats_mean"] == fl["kl_nats_mean"]
        md = render_markdown(report)
        if want_x:
            assert s["kl_mean_x_served_floor"] == pytest.approx(1.0) and s["within_2x_served_floor"]
            assert "1 × served floor" in md and "within 2× of the served floor" in md
        else:
            assert s["kl_mean_x_served_floor"] is None and not s["within_2x_served_floor"]
            assert "n/a × served floor" in md and "the floor is 0" in md


def test_batching_option_is_checked_before_connecting(tmp_path, capsys):
    from logitdiff.cli import main

    wl = tmp_path / "wl.jsonl"
    wl.write_text('{"id": "a", "prompt": "x"}\n')
    capsys.readouterr()
    assert main(["capture", "openai:http://127.0.0.1:9,batching=fast", "--workload", str(wl), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "batching='fast' (expected rounds or serial)" in err, err
    assert not (tmp_path / "r").exists()


def test_compare_noise_floor_of_a_served_reference_is_its_served_floor(tmp_path):
    """`compare --noise-floor RUN` with a served reference captured twice: the rerun is the
    served floor of the report (summary.served_floor.reference), read as its multiple."""
    from logitdiff.api import diff_runs

    rng = np.random.default_rng(5)
    z = rng.normal(0, 3, (20, 64)).astype(np.float32)
    t = rng.integers(0, 64, 20)
    ident = {"kind": "openai", "spec": "openai:A", "batching": "rounds"}
    _topk_run(tmp_path / "ref", z, t, ident)
    _topk_run(tmp_path / "again", z + rng.normal(0, 0.05, z.shape).astype(np.float32), t, ident)
    _topk_run(tmp_path / "cand", z + rng.normal(0, 0.3, z.shape).astype(np.float32), t, {**ident, "spec": "openai:B"})
    rep = diff_runs(tmp_path / "ref", tmp_path / "cand", tmp_path / "rep", noise_floor=tmp_path / "again", bootstrap=5)
    s = rep["summary"]
    fl = s["served_floor"]
    assert fl["candidate"] is None and fl["reference"]["batching"] == "rounds"
    assert fl["kl_nats_mean"] == s["noise_floor"]["kl_nats_mean"] > 0
    assert "compare --noise-floor" in fl["reference"]["measured_by"]
    assert s["kl_mean_x_served_floor"] == pytest.approx(s["kl_nats_mean"] / fl["kl_nats_mean"]) and s["kl_mean_x_served_floor"] > 2
    assert not s["within_2x_served_floor"] and "× served floor" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("server", ["ref", "cand", "one-slot"])
def test_reference_rows_from_its_generation(served, tmp_path, server):
    """The reference's rows come from its greedy generation (n_probs on every generated token,
    no scoring task per position). batching=serial: they equal, bit for bit, teacher-forced
    scoring of the same tokens on the same server - llama-server's default flags (rounds
    scheduling) and one slot (pinned slot); F32 and Q4_K_M. batching=rounds (other items'
    generation steps as batch mates): the same ids and log-probabilities up to the server's
    batch arithmetic."""
    from logitdiff.capture import capture_reference
    from logitdiff.sources.quantize import build_ladder

    if server == "one-slot":
        ladder = build_ladder(served["root"] / "m", served["root"] / "cache", ["Q4_K_M"])
        srv = start_or_fail(llama_server, ladder["Q4_K_M"], served["root"] / "logs1", parallel=1)
    else:
        srv = served[server]
    try:
        items = read_workload(served["wl"])
        with open_source(f"openai:{srv.url},top_k={K},batching=serial") as src:
            assert "bit-identical" in src.identity()["reference_rows"]
            capture_reference(src, items, tmp_path / "ref")
            tasks = src.server_stats["tasks"]
        ref = RunReader(tmp_path / "ref")
        n = ref.manifest["n_positions"]
        # items whose generation kept a row per token took no scoring task (llama-server drops the
        # probabilities of a generated byte token, frequent on this random model: those are scored)
        assert tasks < n
        with open_source(f"openai:{srv.url},top_k={K},batching=serial") as src:
            capture_candidate(src, ref, tmp_path / "tf")
            assert src.server_stats["tasks"] >= n  # teacher-forced: a task per position
        a, b = _rows(ref), _rows(RunReader(tmp_path / "tf"))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        with open_source(f"openai:{srv.url},top_k={K}") as src:  # rounds: from the generation too
            assert "batch mates" in src.identity()["reference_rows"]
            capture_reference(src, items, tmp_path / "ref_rounds")
            rounds = RunReader(tmp_path / "ref_rounds")
            assert src.server_stats["tasks"] < rounds.manifest["n_positions"]
            capture_candidate(src, rounds, tmp_path / "tf_rounds")  # teacher-forced, rounds
        comp = compare_runs(rounds, RunReader(tmp_path / "tf_rounds"))
        # a misaligned or foreign row costs nats; batch arithmetic ~1e-3 (measured 3e-3 at most on
        # this Q4_K_M server, 1e-14 or 0 on most positions)
        assert comp.columns["kl_nats"].mean() < 1e-2 and comp.columns["top1_match"].mean() > 0.9
    finally:
        if server == "one-slot":
            srv.stop()


def test_prefetched_block_is_the_block_scored_now(served, tmp_path):
    """ServedSource.prefetch (what `run` uses to score a served candidate on each reference block
    while the reference generates the next): the block's rows, taken later by score_many of the
    same block, are the rows scoring it then gives (serial: bit for bit), scored once; another
    grouping of the same pairs is scored, not answered from the prefetch; at most
    PREFETCH_BLOCKS blocks wait; closing with a block never asked for neither hangs nor leaks."""
    from logitdiff.capture import capture_reference
    from logitdiff.sources.served.base import PREFETCH_BLOCKS

    with open_source(f"openai:{served['ref'].url},top_k={K}") as src:
        ref = RunReader(capture_reference(src, read_workload(served["wl"]), tmp_path / "ref"))
    pairs = [(it.prompt_ids, it.teacher_ids) for it in ref.items()]
    spec = f"openai:{served['cand'].url},top_k={K},batching=serial"
    with open_source(spec) as src:
        want = src.score_many(pairs[:4])
    with open_source(spec) as src:
        t0 = src.server_stats["tasks"]
        assert src.prefetch(pairs[:4])
        got = src.score_many(pairs[:4])
        assert src.server_stats["tasks"] - t0 == sum(len(t) for _, t in pairs[:4])  # once
        for g, w in zip(got, want):
            assert np.array_equal(g.ids, w.ids) and np.array_equal(g.logprobs, w.logprobs)
        assert src.prefetch(pairs[:2])
        next(iter(src._prefetched.values())).result()  # done: serial rows, no batch mate from it
        again = src.score_many(pairs[1::-1])  # not the prefetched block: scored now
        assert np.array_equal(again[1].logprobs, want[0].logprobs)
        assert [src.prefetch(pairs[k:k + 1]) for k in range(2, 2 + PREFETCH_BLOCKS)] == [True] * (PREFETCH_BLOCKS - 1) + [False]
    assert src._client is None and not src._prefetched  # closed with blocks never asked for


def test_reference_rows_shown_in_how_measured(served, tmp_path):
    """Where a served reference's rows came from (report.json's reference.identity.reference_rows:
    its greedy generation, alone in its batches or with other items' steps as batch mates, or
    scored teacher-forced) is in the how-measured lines of report.md and of the page, as
    report.json says it, for each batching; a reference without it gets no such line."""
    import html

    from logitdiff.api import diff_runs
    from logitdiff.capture import capture_reference

    items = read_workload(served["wl"])
    said = {}
    for batching in ("serial", "rounds"):
        with open_source(f"openai:{served['ref'].url},top_k={K},batching={batching}") as src:
            ref = RunReader(capture_reference(src, items, tmp_path / f"ref-{batching}"))
        with open_source(f"openai:{served['cand'].url},top_k={K},batching=serial") as src:
            cand = capture_candidate(src, ref, tmp_path / f"cand-{batching}")
        out = tmp_path / f"rep-{batching}"
        rep = diff_runs(ref.path, cand, out, bootstrap=0)
        said[batching] = rep["reference"]["identity"]["reference_rows"]
        head = (out / "report.md").read_text().split("## Summary")[0]  # the lines above any figure
        assert f"- reference rows: {said[batching]}" in head
        page = (out / "report.html").read_text()
        assert f"<dt>reference rows</dt><dd>{html.escape(said[batching], quote=True)}</dd>" in page
    assert "bit-identical" in said["serial"] and "batch mates" in said["rounds"]
    # a reference whose identity does not say it (a file source): no line
    from test_compare import make_run

    rng = np.random.default_rng(0)
    lg = {"a": rng.normal(0, 1, (5, 40)).astype(np.float32)}
    r = make_run(tmp_path / "plain-ref", lg, {"a": lg["a"].argmax(1)}, vocab=40)
    diff_runs(r, r, tmp_path / "plain", bootstrap=0)
    assert "reference rows" not in (tmp_path / "plain" / "report.md").read_text()
    assert "<dt>reference rows</dt>" not in (tmp_path / "plain" / "report.html").read_text()


def _prefetch_threads():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("logitdiff-prefetch")]


def test_close_on_a_hung_server_cancels_the_block_in_flight(served):
    """A prefetched block whose server hangs (a real proxy on 127.0.0.1 in front of the real
    candidate server holds its scoring requests unanswered): close() and Ctrl-C while
    score_many waits for that block both return within seconds, not after the request
    timeout; the request is cancelled, no prefetch thread is left, and the closed source
    refuses further work in one line."""
    import os
    import signal
    import threading
    import time

    from servers import CountingProxy
    from logitdiff.errors import LogitdiffError
    from logitdiff.sources.served.client import CLOSE_WAIT_S

    timeout = 30  # the request timeout close() must not wait out
    pairs = [([1, 2, 3, 4], [5, 6, 7])]
    with CountingProxy(served["cand"].url) as px:
        src = open_source(f"openai:{px.url},top_k={K},timeout={timeout},retries=1")
        px.hang.add("/completion")  # after the handshake, which scores a probe pair
        assert src.prefetch(pairs) and px.held.wait(30)
        t0 = time.monotonic()
        src.close()
        took = time.monotonic() - t0
        assert took < 2 * CLOSE_WAIT_S + 1, f"close took {took:.1f} s with a hung server (timeout {timeout} s)"
        with pytest.raises(LogitdiffError, match="closed"):
            src.score_many(pairs)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while _prefetch_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _prefetch_threads()
        # Ctrl-C while the job waits for that block: the interrupt, then close, both prompt
        px.hang.clear()
        with open_source(f"openai:{px.url},top_k={K},timeout={timeout},retries=1") as src:
            px.held.clear()
            px.hang.add("/completion")
            assert src.prefetch(pairs) and px.held.wait(30)
            # Ctrl-C as in a terminal, even where pytest runs as a background job (SIGINT ignored)
            before = signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
                t0 = time.monotonic()
                with pytest.raises(KeyboardInterrupt):
                    with src:
                        src.score_many(pairs)  # the prefetched block: waits on the hung server
                took = time.monotonic() - t0
            finally:
                signal.signal(signal.SIGINT, before)
        assert took < 2 * CLOSE_WAIT_S + 1.5, f"Ctrl-C and close took {took:.1f} s with a hung server (timeout {timeout} s)"
        assert src._client is None


@pytest.mark.parametrize("overlap", ["on", "auto"])
def test_run_scores_the_served_candidate_on_reference_blocks_ahead(served, tmp_path, monkeypatch, overlap):
    """`logitdiff run`, served reference and candidate, batching=serial: the candidate, scored on
    each reference block while the reference generates the next (prefetch, overlap=on), has the
    rows a separate teacher-forced capture on the run's reference gives, bit for bit; with
    overlap=auto and both servers on this host it is scored after (no prefetch), same rows."""
    from logitdiff.sources.served.base import ServedSource

    blocks = []
    real = ServedSource.prefetch
    monkeypatch.setattr(ServedSource, "prefetch", lambda self, batch: blocks.append(len(batch)) or real(self, batch))
    out = tmp_path / "out"
    cand_spec = f"openai:{served['cand'].url},top_k={K},batching=serial"
    summary = run_pipeline(RunConfig(reference=f"openai:{served['ref'].url},top_k={K},batching=serial",
                                     candidates=[f"{cand_spec},overlap={overlap}"],
                                     workload=str(served["wl"]), out=str(out), noise_floor=False, flips=False,
                                     correctness=False, html=False, bootstrap=0))
    n_items = len(read_workload(served["wl"]))
    assert sum(blocks) == (n_items if overlap == "on" else 0)  # every generated item handed ahead, or none
    name = summary["candidates"][0]["name"]
    ref = RunReader(out / "runs" / "reference")
    with open_source(cand_spec) as src:
        alone = RunReader(capture_candidate(src, ref, tmp_path / "alone"))
    a, b = _rows(RunReader(out / "runs" / f"candidate-{name}")), _rows(alone)
    assert a[0].shape[0] == ref.manifest["n_positions"]
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_prefetched_blocks_are_consumed_not_requested_again(served, tmp_path, monkeypatch):
    """`run` with overlap=on: every block the candidate scored ahead, on the reference's blocks
    while the reference generated the next, is the block its capture then takes, never asked
    for again: the candidate server (behind a real counting proxy on 127.0.0.1) gets exactly
    the scoring requests of overlap=off, each block is scored on the prefetch thread and none
    on the capture's own, and the candidate's rows and report are those of overlap=off."""
    import threading

    from servers import CountingProxy
    from logitdiff.sources.served.base import ServedSource

    scored: list[tuple[str, str, int]] = []  # (endpoint, thread, pairs) of every block a served source scored
    probe = [([0, 1], [2])]  # the handshake's pair (ServedSource._preflight), scored by every open
    real = ServedSource._score_now

    def score_now(self, batch):
        if [(list(p), list(t)) for p, t in batch] != probe:
            scored.append((self.roots[0], threading.current_thread().name, len(batch)))
        return real(self, batch)

    monkeypatch.setattr(ServedSource, "_score_now", score_now)
    n_items = len(read_workload(served["wl"]))
    requests, threads, rows, kl = {}, {}, {}, {}
    for overlap in ("on", "off"):
        scored.clear()
        out = tmp_path / overlap
        with CountingProxy(served["cand"].url) as px:
            summary = run_pipeline(RunConfig(
                reference=f"openai:{served['ref'].url},top_k={K},batching=serial",
                candidates=[f"openai:{px.url},top_k={K},batching=serial,overlap={overlap}"], workload=str(served["wl"]),
                out=str(out), noise_floor=False, flips=False, correctness=False, html=False, bootstrap=0))
            requests[overlap] = px.counts["/completion"]
        threads[overlap] = [(t, n) for root, t, n in scored if root == px.url]  # the candidate's blocks
        name = summary["candidates"][0]["name"]
        rows[overlap] = _rows(RunReader(out / "runs" / f"candidate-{name}"))
        kl[overlap] = json.loads((out / "reports" / name / "report.json").read_text())["summary"]["metrics"]["kl_nats"]
    main = threading.main_thread().name
    # every item's block: after the reference, on the capture's thread (off); ahead, on the
    # prefetch thread, and none of them again on the capture's (on)
    assert all(t == main for t, _ in threads["off"]) and sum(n for _, n in threads["off"]) == n_items
    assert len(threads["on"]) > 1 and all(t.startswith("logitdiff-prefetch") for t, _ in threads["on"]), threads["on"]
    assert sum(n for _, n in threads["on"]) == n_items
    assert requests["on"] == requests["off"] > n_items  # serial: a request per pair at least, none repeated
    assert np.array_equal(rows["on"][0], rows["off"][0]) and np.array_equal(rows["on"][1], rows["off"][1])
    assert kl["on"] == kl["off"]


def test_overlap_rule_compares_hosts(served):
    """Who `run` scores ahead: never on the reference's own server; overlap=on on another server;
    off never; auto only when the hosts differ (loopback spellings are one host)."""
    from types import SimpleNamespace

    from logitdiff.sources.served.client import endpoint_host

    assert endpoint_host("http://127.0.0.1:8080") == endpoint_host("http://localhost:9000/v1") == endpoint_host("http://[::1]:1")
    assert endpoint_host("http://10.0.0.2:8000") != endpoint_host("http://10.0.0.3:8000")
    port = served["ref"].url.rsplit(":", 1)[1]
    here, own = SimpleNamespace(roots=[f"http://localhost:{port}"]), SimpleNamespace(roots=[served["cand"].url.rstrip("/")])
    away = SimpleNamespace(roots=["http://10.9.8.7:8000"])
    want = {"on": (True, True, False), "off": (False, False, False), "auto": (False, True, False)}
    for overlap, (w_here, w_away, w_own) in want.items():
        with open_source(f"openai:{served['cand'].url},top_k={K},overlap={overlap}") as src:
            assert (src.scores_ahead_of(here), src.scores_ahead_of(away), src.scores_ahead_of(own)) == (w_here, w_away, w_own), overlap
