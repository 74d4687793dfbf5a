"""Importers: llama.cpp --kl-divergence-base files (written in their exact layout) and npz."""

import os
import struct

import numpy as np
import pytest
from scipy.special import log_softmax

from logitdiff.cli import main
from logitdiff.errors import LogitdiffError
from logitdiff.store.importers import import_llamacpp_kld, import_npz, read_kld_header, write_llamacpp_kld
from logitdiff.store import RunReader


def _kld_inputs(n_chunk=3, n_ctx=16, V=301, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 4, (n_chunk, n_ctx, V)).astype(np.float32)
    tokens = rng.integers(0, V, (n_chunk, n_ctx)).astype(np.int32)
    return logits, tokens


def test_kld_layout_is_llamacpp_exact(tmp_path):
    """Byte layout: magic, 3 int32, tokens, (n_ctx-1-n_ctx/2) rows of 2*((V+1)/2)+4 uint16."""
    logits, tokens = _kld_inputs(n_chunk=2, n_ctx=10, V=301)
    f = tmp_path / "base.kld"
    write_llamacpp_kld(f, logits, tokens)
    raw = f.read_bytes()
    assert raw[:8] == b"_logits_"
    assert struct.unpack("<iii", raw[8:20]) == (10, 301, 2)
    nv = 2 * ((301 + 1) // 2) + 4
    assert len(raw) == 20 + 4 * 10 * 2 + 2 * nv * (10 - 1 - 5) * 2
    # First row of chunk 0: scale, min_log_prob and a quantised row decoding to log p.
    off = 20 + 4 * 20
    scale, minlp = struct.unpack("<ff", raw[off : off + 8])
    q = np.frombuffer(raw, dtype="<u2", count=301, offset=off + 8)
    z = logits[0, 5].astype(np.float64)
    lp = log_softmax(z)
    top = lp.max()
    assert minlp == pytest.approx(max(lp.min(), top - 16), abs=1e-4)
    kept = lp > minlp + 1e-3
    np.testing.assert_allclose(scale * q[kept] + minlp, lp[kept], atol=16 / 65535 + 1e-5)


def test_kld_import_positions_and_values(tmp_path):
    logits, tokens = _kld_inputs()
    f = tmp_path / "base.kld"
    write_llamacpp_kld(f, logits, tokens)
    run = import_llamacpp_kld(f, tmp_path / "run")
    r = RunReader(run)
    assert r.vocab_size == 301
    items = r.items()
    assert [it.id for it in items] == ["chunk-00000", "chunk-00001", "chunk-00002"]
    first = 16 // 2
    for c, it in enumerate(items):
        # Prompt: tokens[0..first]; teacher: the scored second half; row t predicts tokens[first+1+t].
        assert it.prompt_ids == tokens[c, : first + 1].tolist()
        assert it.teacher_ids == tokens[c, first + 1 :].tolist()
        assert it.positions == list(range(16 - 1 - first))
        got = log_softmax(np.asarray(r.logits(it), dtype=np.float64), axis=1)
        want = log_softmax(logits[c, first : 16 - 1].astype(np.float64), axis=1)
        # Quantisation: 16 bits over a 16-nat range, and the floor at max - 16.
        p = np.exp(want)
        kl = (p * (want - got)).sum(1)
        assert np.all(kl < 1e-5)
        np.testing.assert_array_equal(got.argmax(1), want.argmax(1))


def test_kld_bos_replacement(tmp_path):
    logits, tokens = _kld_inputs(n_chunk=1)
    f = tmp_path / "base.kld"
    write_llamacpp_kld(f, logits, tokens)
    r = RunReader(import_llamacpp_kld(f, tmp_path / "run", bos_id=7))
    assert r.items()[0].prompt_ids[0] == 7
    assert r.items()[0].prompt_ids[1:] == tokens[0, 1:9].tolist()


def test_kld_import_then_compare_with_itself_is_zero(tmp_path):
    logits, tokens = _kld_inputs()
    f = tmp_path / "base.kld"
    write_llamacpp_kld(f, logits, tokens)
    assert main(["import", "llamacpp-kld", str(f), "--out", str(tmp_path / "a")]) == 0
    assert main(["import", "llamacpp-kld", str(f), "--out", str(tmp_path / "b")]) == 0
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep"), "--bootstrap", "50"]) == 0
    import json

    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["summary"]["kl_nats_max"] == 0.0
    assert rep["summary"]["top1_match_rate"] == 1.0
    assert rep["summary"]["paired_prompts"] == 3


def test_kld_truncated_and_foreign(tmp_path, capsys):
    logits, tokens = _kld_inputs()
    f = tmp_path / "base.kld"
    write_llamacpp_kld(f, logits, tokens)
    data = f.read_bytes()
    t = tmp_path / "trunc.kld"
    t.write_bytes(data[:-100])
    with pytest.raises(LogitdiffError, match="truncated"):
        read_kld_header(t)
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"GGUF" + b"\0" * 100)
    assert main(["import", "llamacpp-kld", str(foreign), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "foreign.bin" in err and "_logits_" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
    assert main(["import", "llamacpp-kld", str(t), "--out", str(tmp_path / "r2")]) == 2
    assert "truncated" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def _npz(path, V=40, items=("a", "b"), T=5, seed=0, **override):
    rng = np.random.default_rng(seed)
    n = len(items) * T
    d = dict(
        logits=rng.normal(0, 2, (n, V)).astype(np.float32),
        token_ids=rng.integers(0, V, n),
        item_ids=np.repeat(np.array(items), T),
        positions=np.tile(np.arange(T), len(items)),
    )
    d.update(override)
    np.savez(path, **d)
    return d


def test_npz_round_trip(tmp_path):
    d = _npz(tmp_path / "x.npz")
    r = RunReader(import_npz(tmp_path / "x.npz", tmp_path / "run"))
    assert [it.id for it in r.items()] == ["a", "b"]
    np.testing.assert_array_equal(np.concatenate([r.logits(it) for it in r.items()]), d["logits"])
    np.testing.assert_array_equal(np.concatenate([it.next_tokens for it in r.items()]), d["token_ids"])


def test_npz_unordered_positions_are_sorted(tmp_path):
    d = _npz(tmp_path / "x.npz", items=("a",), positions=np.array([3, 0, 4, 1, 2]))
    r = RunReader(import_npz(tmp_path / "x.npz", tmp_path / "run"))
    it = r.items()[0]
    assert it.positions == [0, 1, 2, 3, 4]
    order = np.argsort([3, 0, 4, 1, 2])
    np.testing.assert_array_equal(r.logits(it), d["logits"][order])


@pytest.mark.parametrize(
    "override,match",
    [
        ({"positions": np.array([0, 0, 1, 2, 3, 0, 1, 2, 3, 4])}, "position 0 twice"),
        ({"token_ids": np.full(10, 99)}, "token_ids"),
    ],
)
def test_npz_bad_input(tmp_path, override, match):
    _npz(tmp_path / "x.npz", **override)
    with pytest.raises(LogitdiffError, match=match):
        import_npz(tmp_path / "x.npz", tmp_path / "run")


def test_npz_nan_names_item_and_position(tmp_path):
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(10, 40)).astype(np.float32)
    lg[7, 3] = np.inf
    _npz(tmp_path / "x.npz", logits=lg)
    with pytest.raises(LogitdiffError, match="item 'b'.*position 2"):
        import_npz(tmp_path / "x.npz", tmp_path / "run")


def test_npz_missing_array(tmp_path):
    np.savez(tmp_path / "x.npz", logits=np.zeros((2, 3)))
    with pytest.raises(LogitdiffError, match="token_ids"):
        import_npz(tmp_path / "x.npz", tmp_path / "run")


@pytest.mark.parametrize("what", ["npz", "kld", "merge"])
def test_library_imports_and_merge_hold_the_output_lock_for_the_whole_call(tmp_path, monkeypatch, what):
    """Called from the library (no CLI around them), import_npz, import_llamacpp_kld and
    merge_runs hold --out's lock from their start, through the checks of their input, not
    only while they write (before, another writer could take the output meanwhile and one
    replaced the other's whole): a second writer (another thread) asking when the write
    begins is refused; after the call the lock is free and nothing is left beside out."""
    import threading

    import logitdiff.store.importers as importers
    import logitdiff.capture.shards as shards
    from logitdiff.store.files import locked

    out = tmp_path / "o" / "run"
    probes: list[str] = []

    def second_writer() -> None:
        def other():
            try:
                with locked(out):
                    probes.append("let in")
            except LogitdiffError as e:
                probes.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()

    mod = shards if what == "merge" else importers
    real = mod.writing

    def spy(*a, **k):
        second_writer()
        return real(*a, **k)

    if what == "merge":
        _npz(tmp_path / "x.npz")
        src = import_npz(tmp_path / "x.npz", tmp_path / "shard")
    monkeypatch.setattr(mod, "writing", spy)
    if what == "npz":
        _npz(tmp_path / "x.npz")
        import_npz(tmp_path / "x.npz", out)
    elif what == "kld":
        logits, tokens = _kld_inputs()
        write_llamacpp_kld(tmp_path / "base.kld", logits, tokens)
        import_llamacpp_kld(tmp_path / "base.kld", out)
    else:
        from logitdiff.capture.shards import merge_runs

        merge_runs([src], out)
    assert len(probes) == 1 and "another thread of this logitdiff process" in probes[0], probes
    assert RunReader(out).manifest["status"] == "complete"
    assert sorted(os.listdir(out.parent)) == ["run"]
    second_writer()
    assert probes[-1] == "let in"
