"""Streaming store pieces at scale, without a model: items whose rows run across chunk
files, chunks flushed by bytes, bf16 bits through the writer, row blocks across item
boundaries, resume after a kill in the middle of an item, and the top-K lookup without an
[N, K, K] array."""

from __future__ import annotations

import numpy as np
import pytest

from logitdiff.numerics import metrics as M
from logitdiff.errors import LogitdiffError
from logitdiff.store.kinds.rows import NPY_DATA_OFFSET
from logitdiff.store import RunItem, RunReader, RunWriter, f32_to_bf16, bf16_to_f32, parse_chunk_size, reblock

V = 300
SIZES = [5, 1500, 0, 3000, 7]


def _item(i, n):
    return RunItem(id=f"i{i}", prompt_ids=[1], teacher_ids=[k % V for k in range(n)], positions=list(range(n)))


def _write(path, dtype, rng, chunk=1 << 20, step=97):
    w = RunWriter(path, source={"spec": "t"}, vocab_size=V, tokenizer_hash="h", dtype=dtype, chunk_bytes=chunk)
    want = {}
    for i, n in enumerate(SIZES):
        z = rng.normal(size=(n, V)).astype(np.float32)
        w.begin_item(_item(i, n))
        for a in range(0, n, step):
            blk = z[a : a + step]
            # bf16 runs take float32 rows or bf16 bits alike
            w.add_rows(f32_to_bf16(blk) if dtype == "bfloat16" and (a // step) % 2 else blk)
        w.end_item()
        want[f"i{i}"] = bf16_to_f32(f32_to_bf16(z)) if dtype == "bfloat16" else z
    w.finish()
    return want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_items_span_chunks_flushed_by_bytes(tmp_path, dtype):
    want = _write(tmp_path / "r", dtype, np.random.default_rng(0))
    r = RunReader(tmp_path / "r")
    row_bytes = V * (2 if dtype == "bfloat16" else 4)
    rows = [c["rows"] for c in r.manifest["chunks"]]
    # every chunk but the last holds the rows of 1 MiB and at most one 97-row block more
    per_chunk = (1 << 20) // row_bytes
    assert all(per_chunk <= n < per_chunk + 97 for n in rows[:-1])
    assert sum(rows) == r.manifest["n_positions"] == sum(SIZES)
    items = r.items()
    assert [it.id for it in items] == [f"i{i}" for i in range(len(SIZES))]
    assert any(it.chunk < c for it in items for c in range(len(rows)) if it.positions and c > it.chunk)
    for it in items:
        assert np.array_equal(r.logits(it), want[it.id])
    cat = np.concatenate([want[it.id] for it in items])
    blocks = list(r.row_blocks(items, 333))
    assert [len(b) for b in blocks[:-1]] == [333] * (len(blocks) - 1)
    assert all(b.dtype == np.float32 for b in blocks)
    assert np.array_equal(np.concatenate(blocks), cat)
    if dtype == "bfloat16":
        raw = np.concatenate(list(r.row_blocks(items, 1000, raw=True)))
        assert raw.dtype == np.uint16 and np.array_equal(bf16_to_f32(raw), cat)
        data = sum((r.path / "chunks" / c["data"]).stat().st_size for c in r.manifest["chunks"])
        assert data == sum(SIZES) * V * 2 + NPY_DATA_OFFSET * len(rows)  # 2 bytes per entry + .npy header pages


def test_item_rows_must_match_positions(tmp_path):
    w = RunWriter(tmp_path / "r", source={"spec": "t"}, vocab_size=V, tokenizer_hash="h")
    w.begin_item(_item(0, 4))
    w.add_rows(np.zeros((3, V), np.float32))
    with pytest.raises(LogitdiffError, match="3 rows given for 4"):
        w.end_item()
    with pytest.raises(LogitdiffError, match="logits shape"):
        w.add_rows(np.zeros((2, V), np.float32))  # one row left
    bad = np.zeros((1, V), np.float32)
    bad[0, 7] = np.nan
    with pytest.raises(LogitdiffError, match="NaN/inf logits at output position 3"):
        w.add_rows(bad)
    bits = f32_to_bf16(np.full((1, V), np.inf, np.float32))
    w2 = RunWriter(tmp_path / "b", source={"spec": "t"}, vocab_size=V, tokenizer_hash="h", dtype="bfloat16")
    w2.begin_item(_item(0, 1))
    with pytest.raises(LogitdiffError, match="NaN/inf"):
        w2.add_rows(bits)


def test_resume_after_kill_mid_item(tmp_path):
    """Chunks flushed in the middle of an item are on disk, the item is not listed: resume
    redoes it, and the orphan rows are never read."""
    rng = np.random.default_rng(1)
    w = RunWriter(tmp_path / "r", source={"spec": "t"}, vocab_size=V, tokenizer_hash="h", chunk_bytes=1 << 20)
    a = rng.normal(size=(10, V)).astype(np.float32)
    w.add(_item(0, 10), logits=a)
    w.begin_item(_item(1, 3000))
    w.add_rows(rng.normal(size=(2000, V)).astype(np.float32))  # > 1 MiB: chunks go to disk
    w.flush()
    del w  # killed here
    w = RunWriter(tmp_path / "r", source={"spec": "t"}, vocab_size=V, tokenizer_hash="h", chunk_bytes=1 << 20, resume=True)
    assert w.done_ids() == {"i0"}
    b = rng.normal(size=(3000, V)).astype(np.float32)
    w.add(_item(1, 3000), logits=b)
    w.finish()
    r = RunReader(tmp_path / "r")
    got = {it.id: it for it in r.items()}
    assert np.array_equal(r.logits(got["i0"]), a) and np.array_equal(r.logits(got["i1"]), b)
    assert r.manifest["n_positions"] == 3010
    assert np.array_equal(np.concatenate(list(r.row_blocks(r.items(), 64))), np.concatenate([a, b]))


def test_topk_rows_span_chunks(tmp_path):
    rng = np.random.default_rng(2)
    w = RunWriter(tmp_path / "t", source={"spec": "t"}, vocab_size=V, tokenizer_hash="h", store="topk:4", chunk_bytes=1 << 20)
    n = 100_000  # 88 bytes a row: ~11,900 rows per chunk
    # valid rows (validate.topk_rows): distinct ids in [0, V), log-probabilities <= 0
    ids, lp = (rng.integers(0, V, (n, 1)) + np.arange(4)) % V, -np.abs(rng.normal(size=(n, 4)))
    w.begin_item(_item(0, n))
    for a in range(0, n, 7000):
        w.add_rows(stored={"ids": ids[a : a + 7000], "logprobs": lp[a : a + 7000]})
    w.end_item()
    w.finish()
    r = RunReader(tmp_path / "t")
    assert len(r.manifest["chunks"]) >= 8
    t = r.topk(r.items()[0])
    assert np.array_equal(t["ids"], ids) and np.array_equal(t["logprobs"], lp)
    blocks = list(r.row_blocks(r.items(), 30_000))
    assert np.array_equal(np.concatenate([b["ids"] for b in blocks]), ids)


def test_reblock_lines_up_two_streams():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1000, 3))
    cuts_a = [0, 5, 5, 300, 301, 999, 1000]
    cuts_b = [0, 400, 1000]
    a = list(reblock((x[i:j] for i, j in zip(cuts_a, cuts_a[1:])), 128))
    b = list(reblock((x[i:j] for i, j in zip(cuts_b, cuts_b[1:])), 128))
    assert [len(p) for p in a] == [len(p) for p in b] == [128] * 7 + [104]
    for p, q in zip(a, b):
        assert np.array_equal(p, q)
    whole = x[:128]
    assert next(reblock([whole], 128)) is whole  # an exact block passes without a copy


def test_chunk_size_parsing():
    assert parse_chunk_size(None) == 64 << 20
    assert parse_chunk_size("256MiB") == 256 << 20
    assert parse_chunk_size("1GiB") == 1 << 30
    assert parse_chunk_size("2MB") == 2_000_000
    assert parse_chunk_size("1048576") == 1 << 20
    for bad in ("12", "lots", "5XB", "0.5MiB"):
        with pytest.raises(LogitdiffError, match="--chunk-size"):
            parse_chunk_size(bad)


def test_topk_lookup_equals_pairwise_and_is_linear_in_k():
    """The sort-based lookup of metrics.topk equals the pairwise [N, K, K] definition, with
    absent (-1) entries on either side, and K = 1,024 over 512 rows runs without the 4 GB
    such an array would take."""
    rng = np.random.default_rng(4)
    for _ in range(100):
        n, k, kc = (int(x) for x in rng.integers(1, 12, 3))
        vv = int(rng.integers(max(k, kc), 40))
        r = np.stack([rng.choice(vv, k, replace=False) for _ in range(n)])
        c = np.stack([rng.choice(vv, kc, replace=False) for _ in range(n)])
        r[rng.random(r.shape) < 0.1] = -1
        c[rng.random(c.shape) < 0.1] = -1
        q = rng.random(c.shape)
        eq = (r[:, :, None] == c[:, None, :]) & (r >= 0)[:, :, None] & (c >= 0)[:, None, :]
        in_q, q_at = M._lookup(r, r >= 0, c, c >= 0, q)
        assert np.array_equal(in_q, eq.any(2))
        assert np.array_equal(q_at, np.where(eq.any(2), (eq * q[:, None, :]).sum(2), 0.0))
    n, k, vv = 512, 1024, 248_320
    ids = np.stack([rng.choice(vv, k, replace=False) for _ in range(n)])
    lp = np.log(np.full((n, k), 0.9 / k))
    t = M.topk(ids, lp, ids, lp, vv)
    assert np.array_equal(t["kl_nats"], np.zeros(n)) and (t["shared_tokens"] == k).all()
