"""The hidden-state store (``--store hidden``): a bf16 reference's logits kept as its final
hidden states plus the output head, decoded bit for bit. Real models: the bundled trained
model (transformers BF16) and a random bf16 Llama at V = 248,320."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _models import WIDE_VOCAB, make_random_llama, make_wide_llama
from logitdiff.store import hidden as Hs
from logitdiff.store.kinds.hidden import HiddenStore
from logitdiff.builtin import WORKLOAD
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.sources import open_source
from logitdiff.store import RunItem, RunReader, RunWriter, aligned_blocks, bf16_to_f32
from logitdiff.workload import read_workload


def tree_bytes(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} if path.exists() else {}


# --------------------------------------------------------------------------------------
# the rounding, against exact rational arithmetic
# --------------------------------------------------------------------------------------


def _bf16_nearest_even(x: float) -> int:
    """Independent reference: the bf16 bits nearest to x (ties to even), by exact
    rational comparison of the two bf16 neighbours."""
    f = np.float32(x)  # float32 only to enumerate neighbours; the choice is exact below
    u = int(np.array(f, np.float32).view(np.uint32)) >> 16
    cands = {(u + d) & 0xFFFF for d in (-1, 0, 1, 2)}
    xv = Fraction(x)

    def val(b):
        return Fraction(float(np.array(b << 16, np.uint32).view(np.float32)))

    best = min(cands, key=lambda b: (abs(val(b) - xv), b & 1))
    return best


def test_round_bf16_is_nearest_even_in_one_rounding():
    rng = np.random.default_rng(1)
    xs = list(rng.normal(0, 20, 3000)) + list(rng.normal(0, 1e-3, 500))
    # exact midpoints between bf16 neighbours (ties), and just beside them: a float32 step
    # in between would round some of these twice
    for b in rng.integers(0x3000, 0x4300, 300):
        lo = float(np.array(int(b) << 16, np.uint32).view(np.float32))
        hi = float(np.array((int(b) + 1) << 16, np.uint32).view(np.float32))
        mid = (lo + hi) / 2
        xs += [mid, -mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf), mid + (hi - lo) * 2**-30]
    xs = np.asarray(xs, np.float64)
    got = Hs.round_bits(xs)
    want = np.array([_bf16_nearest_even(float(x)) for x in xs], np.uint16)
    np.testing.assert_array_equal(got, want)
    # the torch rounding a GPU decode uses: the same bits (run here on the CPU)
    import torch

    for dt in ("bfloat16", "float16"):
        ys = xs[np.abs(xs) < (6e4 if dt == "float16" else 1e38)]
        ys = ys[np.abs(ys) > (1e-4 if dt == "float16" else 1e-37)]
        tb = Hs._round_bits_torch(torch.from_numpy(ys.copy()), dt).numpy().view(np.uint16)
        np.testing.assert_array_equal(tb, Hs.round_bits(ys, dt))


# --------------------------------------------------------------------------------------
# the bundled trained model: bit-identical rows, identical reports
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hid")
    items = read_workload(WORKLOAD)[:10]
    src = open_source("builtin:tiny")
    full = RunReader(capture_reference(src, items, root / "full"))
    hid = RunReader(capture_reference(src, items, root / "hid", store="hidden", chunk_bytes=1 << 20))
    cand = RunReader(capture_candidate(open_source("builtin:tiny,dtype=float32"), full, root / "cand"))
    return root, full, hid, cand


def test_hidden_run_decodes_to_the_full_runs_bits(tiny):
    root, full, hid, _ = tiny
    assert hid.store == "hidden" and hid.dtype == "bfloat16" and not hid.kind.k and isinstance(hid.kind, HiddenStore)
    assert len(hid.manifest["chunks"]) > 1  # 1 MiB chunks: items run across chunk files
    assert [it.id for it in hid.items()] == [it.id for it in full.items()]
    n = 0
    for a, b in aligned_blocks(full.row_pieces(full.items()), hid.row_pieces(hid.items()), 1 << 30):
        assert a.dtype == b.dtype == np.uint16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        n += len(a)
    assert n == full.manifest["n_positions"] > 100
    for it in hid.items()[:3]:
        np.testing.assert_array_equal(hid.logits(it), full.logits(it))
    # what it costs: hidden states (2 bytes per unit) plus a few exceptions per position,
    # and the head once
    chunk_bytes = sum(p.stat().st_size for p in (root / "hid" / "chunks").glob("*.hidden.npz"))
    assert chunk_bytes / n < 2 * 256 + 64
    assert (root / "hid" / "head.npy").stat().st_size == 4096 * 256 * 2 + 128


def test_compare_against_a_hidden_reference_is_the_full_computation(tiny):
    _, full, hid, cand = tiny
    a, b = compare_runs(full, cand), compare_runs(hid, cand)
    assert a.method == b.method
    for k, v in a.columns.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fiub":
            np.testing.assert_array_equal(v, b.columns[k], err_msg=k)
    assert a.columns["kl_nats"].mean() > 0


def test_decode_does_not_depend_on_the_summation_order(tiny):
    """The claim that makes the store exact: every non-exception entry rounds the same for
    any float64 summation order. Sum in reverse, and in eight partial sums."""
    root, full, hid, _ = tiny
    head = hid.kind.head()
    c0 = hid.manifest["chunks"][0]
    raw = Hs.load_chunk(root / "hid" / "chunks" / c0["data"], head.shape[1], hid.vocab_size)
    h = Hs._bits_to_f64(raw["hidden"])
    W = Hs._bits_to_f64(np.asarray(head))
    want = next(iter(full.row_pieces(full.items())))[: len(h)]
    for s in (h[:, ::-1] @ W[:, ::-1].T, sum(h[:, j::8] @ W[:, j::8].T for j in range(8))):
        got = Hs.round_bits(s)
        got[raw["exc_row"], raw["exc_id"]] = raw["exc_bits"]
        np.testing.assert_array_equal(got, want)


def test_merge_of_hidden_shards(tiny, tmp_path):
    _, full, _, _ = tiny
    bf = open_source("builtin:tiny")
    a = capture_candidate(bf, full, tmp_path / "s0", store="hidden", shard="0/2", batch=2)
    b = capture_candidate(bf, full, tmp_path / "s1", store="hidden", shard="1/2", batch=2)
    assert main(["merge", str(a), str(b), "--out", str(tmp_path / "m"), "--chunk-size", "1MiB"]) == 0
    m = RunReader(tmp_path / "m")
    assert m.store == "hidden" and m.manifest["head"] == RunReader(a).manifest["head"]
    assert sorted(it.id for it in m.items()) == sorted(it.id for it in full.items())
    by_id = {it.id: it for it in m.items()}
    for shard in (RunReader(a), RunReader(b)):
        for it in shard.items():
            np.testing.assert_array_equal(m.logits(by_id[it.id]), shard.logits(it))


# --------------------------------------------------------------------------------------
# V = 248,320
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidwide")
    d = make_wide_llama(root / "m", dtype="bfloat16")
    wl = root / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Count {i} items:", "max_tokens": 12}) + "\n" for i in range(3)))
    return root, d, wl


def test_wide_vocabulary_round_trip(wide):
    root, d, wl = wide
    src = open_source(f"hf:{d}")
    items = read_workload(wl)
    full = RunReader(capture_reference(src, items, root / "full"))
    hid = RunReader(capture_reference(src, items, root / "hid", store="hidden", chunk_bytes=8 << 20))
    assert hid.vocab_size == WIDE_VOCAB
    n = 0
    for a, b in aligned_blocks(full.row_pieces(full.items()), hid.row_pieces(hid.items()), 1 << 30):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        n += len(a)
    assert n == 36
    chunk_bytes = sum(p.stat().st_size for p in (root / "hid" / "chunks").glob("*.hidden.npz"))
    # 256 bytes of hidden state per position and ~16 exceptions of ~10 bytes: against
    # 496,640 bytes of bf16 logits
    assert chunk_bytes / n < 2_000
    # a reader's memory is a chunk: 8 MiB of bf16 rows is 16 rows at this vocabulary (a
    # chunk closes once it holds them, so it may end with part of one more source block)
    assert max(c["rows"] for c in hid.manifest["chunks"]) < 2 * (8 << 20) // (2 * WIDE_VOCAB)


# --------------------------------------------------------------------------------------
# refusals: one line, non-zero exit, nothing written
# --------------------------------------------------------------------------------------


def test_sources_that_cannot_fill_it_are_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    for spec in ("builtin:tiny,dtype=float32", "builtin:tiny-F32"):
        assert main(["capture", spec, "--out", str(out), "--store", "hidden"]) != 0
        err = [x for x in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in x]
        assert len(err) == 1 and "--store hidden" in err[0], err
        assert not out.exists() or not any(out.iterdir())


def test_logits_that_are_not_the_head_output_are_refused(tmp_path):
    """A model with a bias or a scaled head: the hidden states do not reproduce the logits."""
    d = make_random_llama(tmp_path / "m", vocab_size=512, layers=1, dtype="bfloat16")
    src = open_source(f"hf:{d}")
    head = src.output_head()
    w = RunWriter(tmp_path / "run", source={"spec": "x"}, vocab_size=512, tokenizer_hash=None, store="hidden",
                  dtype="bfloat16", head=head)
    rng = np.random.default_rng(0)
    h = Hs.round_bits(rng.normal(0, 1, (4, head.shape[1])))
    s = Hs._bits_to_f64(h) @ Hs._bits_to_f64(head).T
    w.begin_item(RunItem(id="x", prompt_ids=[1], teacher_ids=[1, 2, 3, 4], positions=[0, 1, 2, 3]))
    w.add_rows(logits=Hs.round_bits(s), hidden=h)  # the head's output: accepted
    w.end_item()
    w.begin_item(RunItem(id="y", prompt_ids=[1], teacher_ids=[1, 2, 3, 4], positions=[0, 1, 2, 3]))
    with pytest.raises(LogitdiffError, match=r"item 'y': output position 0: \d+ of 512 logits are not the output head"):
        w.add_rows(logits=Hs.round_bits(s + 0.5), hidden=h)  # a bias
    # stored rows from another run (merge): an exception outside the block is refused
    bad = {"hidden": h, "exc_row": np.array([9], np.int32), "exc_id": np.array([0], np.int32), "exc_bits": np.zeros(1, np.uint16)}
    with pytest.raises(LogitdiffError, match=r"item 'y': hidden-state rows uint16 \(4, \d+\) \(or their exceptions\) do not fit"):
        w.add_rows(stored=bad)
    w.close()


def test_damaged_hidden_runs_are_named(tiny, tmp_path):
    import shutil

    root = tiny[0]
    run = tmp_path / "r"
    shutil.copytree(root / "hid", run)
    head = run / "head.npy"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    r = RunReader(run)
    with pytest.raises(LogitdiffError, match=r"head\.npy: sha256 differs"):
        next(iter(r.row_pieces(r.items())))
    head.unlink()
    with pytest.raises(LogitdiffError, match=r"head\.npy: missing"):
        next(iter(RunReader(run).row_pieces(RunReader(run).items())))
    shutil.copy(root / "hid" / "head.npy", head)
    c = run / "chunks" / RunReader(run).manifest["chunks"][0]["data"]
    c.write_bytes(c.read_bytes()[:100])
    with pytest.raises(LogitdiffError, match=r"hidden\.npz: unreadable hidden-state chunk"):
        next(iter(RunReader(run).row_pieces(RunReader(run).items())))


def test_resume_refuses_another_head(tiny, tmp_path):
    root, full, _, _ = tiny
    src = open_source("builtin:tiny")
    out = tmp_path / "r"
    capture_candidate(src, full, out, store="hidden")
    before = tree_bytes(out)
    m = json.loads((out / "manifest.json").read_text())
    m["status"] = "partial"
    m["head"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(m))
    before = tree_bytes(out)
    with pytest.raises(LogitdiffError, match=r"field 'head'"):
        capture_candidate(src, full, out, store="hidden", resume=True)
    assert tree_bytes(out) == before
    assert bf16_to_f32 is not None


def test_a_killed_hidden_capture_resumes_to_the_same_rows(tiny, tmp_path):
    """A kill leaves the manifest listing whole chunks (items whose rows run on past them
    are not listed); --resume scores the rest and the run reads back as the full one."""
    import shutil

    root, full, hid, _ = tiny
    run = tmp_path / "r"
    shutil.copytree(root / "hid", run)
    m = json.loads((run / "manifest.json").read_text())
    keep = m["chunks"][:2]
    assert len(m["chunks"]) > 2
    listed = [json.loads(x) for c in keep for x in (run / "chunks" / c["items"]).read_text().splitlines() if x.strip()]
    for c in m["chunks"][2:]:
        for f in (c["items"], c["data"]):
            (run / "chunks" / f).unlink()
    m.update(status="partial", chunks=keep, n_items=len(listed), n_positions=sum(len(x["positions"]) for x in listed))
    (run / "manifest.json").write_text(json.dumps(m))
    items = read_workload(WORKLOAD)[:10]
    capture_reference(open_source("builtin:tiny"), items, run, store="hidden", resume=True, chunk_bytes=1 << 20)
    done = RunReader(run)
    assert [it.id for it in done.items()] == [it.id for it in full.items()]
    for a, b in zip(done.items(), full.items()):
        np.testing.assert_array_equal(done.logits(a), full.logits(b))


def test_run_with_a_hidden_reference_writes_the_same_reports(tmp_path):
    """A bf16 transformers reference is kept as hidden states by default (auto), and the
    reports equal those against a full reference; a GGUF reference is kept full."""
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps(r) + "\n" for r in read_workload_rows(3)))
    args = ["run", "--reference", "builtin:tiny", "--candidate", "builtin:tiny,dtype=float32", "--workload", str(wl),
            "--no-noise-floor", "--no-flips", "--bootstrap", "10", "--floor", "none"]
    assert main(args + ["--out", str(tmp_path / "a"), "--reference-store", "full"]) == 0
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    assert RunReader(tmp_path / "a" / "runs" / "reference").store == "full"
    ref = RunReader(tmp_path / "b" / "runs" / "reference")
    assert ref.store == "hidden" and (tmp_path / "b" / "runs" / "reference" / "head.npy").exists()
    ra, rb = (json.loads(next((tmp_path / x / "reports").glob("*/report.json")).read_text()) for x in ("a", "b"))
    assert ra["summary"] == rb["summary"] and ra["summary"]["kl_nats_mean"] > 0
    # the default reuses the hidden reference; an explicit other store captures afresh
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    assert RunReader(tmp_path / "b" / "runs" / "reference").manifest["created"] == ref.manifest["created"]
    assert main(args + ["--out", str(tmp_path / "b"), "--reference-store", "full"]) == 0
    assert RunReader(tmp_path / "b" / "runs" / "reference").store == "full"


def test_auto_reference_store_follows_the_source():
    from logitdiff.store.kinds import auto_kind

    assert auto_kind(open_source("builtin:tiny")) == "hidden"
    assert auto_kind(open_source("builtin:tiny,dtype=float32")) == "full"


def read_workload_rows(n):
    return [json.loads(x) for x in WORKLOAD.read_text().splitlines()[:n]]


def _f16_nearest_even(x: float) -> int:
    """Independent reference for float16: nearest of the neighbouring float16 values by
    exact rational comparison, ties to the even bit pattern."""
    u = int(np.array(x, np.float64).astype(np.float16).view(np.uint16))
    cands = {(u + d) & 0xFFFF for d in (-1, 0, 1)}
    xv = Fraction(x)

    def val(b):
        return Fraction(float(np.array(b, np.uint16).view(np.float16)))

    return min(cands, key=lambda b: (abs(val(b) - xv), b & 1))


def test_round_float16_is_nearest_even_in_one_rounding():
    rng = np.random.default_rng(2)
    xs = list(rng.normal(0, 20, 2000))
    for b in rng.integers(0x0800, 0x7000, 300):  # normal float16 patterns
        lo = float(np.array(int(b), np.uint16).view(np.float16))
        hi = float(np.array(int(b) + 1, np.uint16).view(np.float16))
        mid = (lo + hi) / 2
        xs += [mid, -mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)]
    xs = np.asarray(xs, np.float64)
    np.testing.assert_array_equal(Hs.round_bits(xs, "float16"), [_f16_nearest_even(float(x)) for x in xs])


def test_float16_model_round_trip(tmp_path):
    d = make_random_llama(tmp_path / "m", vocab_size=512, layers=1, dtype="float16")
    src = open_source(f"hf:{d}")
    assert src.logits_dtype == "float16"
    items = read_workload(WORKLOAD)[:4]
    full = RunReader(capture_reference(src, items, tmp_path / "full"))
    hid = RunReader(capture_reference(src, items, tmp_path / "hid", store="hidden"))
    assert hid.dtype == "float16" and full.dtype == "float16"
    n = 0
    for a, b in aligned_blocks(full.row_pieces(full.items()), hid.row_pieces(hid.items()), 1 << 30):
        assert a.dtype == b.dtype == np.float16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
        n += len(a)
    assert n == full.manifest["n_positions"] > 0


# --------------------------------------------------------------------------------------
# the compiled decode (float32 dots with a proven bound, float64 where it straddles a
# rounding boundary) against the float64 decode, bit for bit (issue 28)
# --------------------------------------------------------------------------------------


def _float64_decode(block, head, dtype):
    from logitdiff.numerics import kernel

    keep = kernel.hidden_decode
    kernel.hidden_decode = lambda *a, **k: None  # the torch float64 product
    try:
        return Hs.decode(block, head, dtype)
    finally:
        kernel.hidden_decode = keep


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiled_decode_is_the_float64_decode(dtype):
    from logitdiff.numerics import kernel

    if kernel.hidden_decode(np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16), dtype, 1) is None:
        pytest.skip("compiled kernel not built")
    rng = np.random.default_rng(7)
    tdt = getattr(torch, dtype)

    def bits(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to(tdt).view(torch.int16).numpy().view(np.uint16)

    for V, H, n in ((1031, 13, 7), (700, 200, 10), (300, 4100, 4)):  # V, H, n off every block size
        head = bits(rng.normal(0, 0.05, (V, H)) * np.exp(rng.normal(0, 1, (V, 1))))
        hid = bits(rng.normal(0, 1, (n, H)))
        # entries whose exact sum is a rounding midpoint (ties to even) or one ulp of float32
        # beside one: w = (1, 2^-8 (+- 2^-20), 0, ...) against h = (1, 1, 0, ...)
        mids = np.zeros((6, H), np.float32)
        mids[:, 0] = 1.0
        mids[:, 1] = [2**-8, 2**-8 + 2**-20, 2**-8 - 2**-20, 3 * 2**-8, 2**-11, 2**-11 + 2**-22]
        head[:6] = bits(mids)
        hid[0] = bits(np.r_[1.0, 1.0, np.zeros(H - 2)])
        exc = {"exc_row": np.array([1, n - 1], np.int32), "exc_id": np.array([V - 1, 3], np.int32),
               "exc_bits": np.array([0x1234, 0x4321], np.uint16)}
        block = {"hidden": hid, **exc}
        got, fallbacks = kernel.hidden_decode(hid, head, dtype, 2)
        got[exc["exc_row"], exc["exc_id"]] = exc["exc_bits"]
        want = _float64_decode(block, head, dtype)
        np.testing.assert_array_equal(got, want, err_msg=f"{dtype} V={V} H={H} n={n}")
        np.testing.assert_array_equal(Hs.decode(block, head, dtype), want)  # the reader's path
        port, port_fb = kernel.hidden_decode(hid, head, dtype, 2, isa="scalar")  # a CPU without AVX2
        port[exc["exc_row"], exc["exc_id"]] = exc["exc_bits"]
        np.testing.assert_array_equal(port, want, err_msg=f"scalar {dtype} V={V} H={H} n={n}")
        assert port_fb == 0  # no float32 path there
        # the midpoints took the float64 path; with bf16's 8-bit significands most entries
        # did not (float16's 11 bits leave the float32 bound straddling more boundaries)
        assert 4 <= fallbacks and (dtype == "float16" or fallbacks < 0.5 * n * V), (fallbacks, n * V)


def test_compiled_decode_refuses_a_hidden_size_mismatch():
    from logitdiff.numerics import kernel

    if kernel.hidden_decode(np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16), "bfloat16", 1) is None:
        pytest.skip("compiled kernel not built")
    # the kernel would read hidden as [n, 8]: past the end of a [2, 4] array
    with pytest.raises(ValueError, match="hidden size"):
        kernel.hidden_decode(np.zeros((2, 4), np.uint16), np.zeros((5, 8), np.uint16), "bfloat16", 1)
