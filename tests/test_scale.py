"""At V = 248,320: streamed capture, compare and topk-error give the numbers the
unstreamed computation gives, a bf16 reference stores 2 bytes per entry, and
``--store topk:K`` / ``--positions sample:`` never hand out full rows beyond a block.

The model is a random Llama (hidden 128, 2 layers) on the bundled tokenizer widened to
248,320 tokens (tests/_models.py), built offline. Outputs are a few hundred tokens; chunks
are made small (``chunk_bytes``) and the prefill window short (``prefill=64``) so that every
streamed path crosses many block, chunk and item boundaries.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from scipy.special import log_softmax  # noqa: E402

from _models import WIDE_VOCAB, make_wide_llama  # noqa: E402
from logitdiff.numerics import metrics as M  # noqa: E402
from logitdiff.capture import LiveRun, capture_candidate, capture_reference, select_positions  # noqa: E402
from logitdiff.compare import compare_runs  # noqa: E402
from logitdiff.compare.topk_error import topk_error  # noqa: E402
from logitdiff.sources.hf import HFSource  # noqa: E402
from logitdiff.store import RunReader, bf16_to_f32, rows_per_block  # noqa: E402
from logitdiff.workload import Item  # noqa: E402
from logitdiff.store.kinds.rows import NPY_DATA_OFFSET  # noqa: E402

V = WIDE_VOCAB
CHUNK = 4 << 20  # 4 rows of float32 at V = 248,320 per block; 8 bf16 rows per chunk file
ITEMS = [
    Item(id="a", prompt="def fibonacci(n):", max_tokens=120),
    Item(id="b", prompt="The quick brown fox jumps over", max_tokens=80),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_wide_llama(tmp_path_factory.mktemp("wide") / "m", max_positions=1024, dtype="bfloat16", never_eos=True)


@pytest.fixture(scope="module")
def ref16(model_dir):
    with HFSource(model_dir, dtype="bfloat16", threads=1, batch=2, prefill=64) as s:
        yield s


@pytest.fixture(scope="module")
def cand32(model_dir):
    with HFSource(model_dir, dtype="float32", threads=1, batch=2, prefill=64) as s:
        yield s


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ref16, cand32):
    d = tmp_path_factory.mktemp("runs")
    capture_reference(ref16, ITEMS, d / "ref", chunk_bytes=CHUNK)
    ref = RunReader(d / "ref")
    capture_candidate(cand32, ref, d / "cand", chunk_bytes=CHUNK)
    return ref, RunReader(d / "cand")


def _forward_logits(src: HFSource, prompt, teacher) -> np.ndarray:
    """The transformers forward over the whole sequence at once (not our code path): the
    logits of the output positions, float32."""
    ids = torch.tensor([list(prompt) + list(teacher[:-1])])
    with torch.inference_mode():
        z = src.model(input_ids=ids).logits[0, len(prompt) - 1 :, :V].float().numpy()
    return z


def test_vocabulary_is_the_design_point(ref16):
    assert ref16.vocab_size == V and len(ref16.tok) == V


def test_reference_stores_bf16_bits_two_bytes_per_entry(runs):
    ref, cand = runs
    assert ref.dtype == "bfloat16" and cand.dtype == "float32"
    n = ref.manifest["n_positions"]
    assert n == sum(len(it.teacher_ids) for it in ref.items()) == 120 + 80  # eos cannot win: full length
    data = sum((ref.path / "chunks" / c["data"]).stat().st_size for c in ref.manifest["chunks"])
    hdr = NPY_DATA_OFFSET * len(ref.manifest["chunks"])  # one .npy header page per chunk
    assert data == n * V * 2 + hdr
    # items ran on across chunk files (8 bf16 rows each at this chunk size)
    assert len(ref.manifest["chunks"]) >= n // 8
    assert any(it.chunk != ref.manifest["chunks"][-1]["index"] for it in ref.items())


def test_streamed_rows_equal_one_forward_pass(runs, ref16, cand32):
    """Windowed prefill over a KV cache (prefill=64) and the head on 4-row blocks give the
    logits of one transformers forward over the whole sequence.

    Error analysis: both compute the same sums in another order. float32 (candidate): each
    reduction of n <= 384 terms moves by <= n u |terms| (u = 2^-24), through ~10 chained ops
    of magnitude <= |z|max: |dz| <= 10 * 384 * 2^-24 * max|z| ~ 2.3e-4 max|z|. bf16 (reference)
    rounds every activation to 8 bits (u = 2^-8 relative): one flipped rounding changes a
    logit by <= 2^-8 of the terms it feeds, bounded here by 2 * 2^-8 * max|z| per rounding
    chain; we allow 4 such steps (2 layers x attention/MLP): |dz| <= 2^-5 max|z|."""
    ref, cand = runs
    cand_items = {it.id: it for it in cand.items()}  # an item knows its rows in its own run
    for it in ref.items():
        z_ref = ref.logits(it)
        z_cand = cand.logits(cand_items[it.id])
        f16 = _forward_logits(ref16, it.prompt_ids, it.teacher_ids)
        f32 = _forward_logits(cand32, it.prompt_ids, it.teacher_ids)
        assert z_ref.shape == f16.shape == (len(it.teacher_ids), V)
        assert np.abs(z_cand - f32).max() <= 2.3e-4 * np.abs(f32).max()
        assert np.abs(z_ref - f16).max() <= 2.0**-5 * np.abs(f16).max()
        # the stored bf16 logits are bf16 values (no float32 rounding on the way)
        assert np.array_equal(bf16_to_f32(ref.row_blocks([it], 7, raw=True).__next__()), z_ref[:7])


def test_generation_keeps_ids_and_is_greedy_on_the_scored_rows(cand32):
    """Greedy generation keeps ids only, and each id is the argmax of the teacher-forced row
    that predicts it (same model, same head), wherever the winner's lead exceeds what the two
    float32 computations can differ by (2.3e-4 max|z|, see above)."""
    prompt = cand32.render(ITEMS[0])
    g = cand32.generate(prompt, 60)
    assert not hasattr(g, "logits") and len(g.token_ids) == 60
    z = cand32.score(prompt, g.token_ids)
    top2 = np.sort(z, 1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * 2.3e-4 * np.abs(z).max(1)
    assert clear.sum() >= 50
    assert np.array_equal(z.argmax(1)[clear], np.asarray(g.token_ids)[clear])


def _top_k(z: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest of each row, value descending, lowest id first on ties (bf16
    logits tie often): every value >= the k-th largest, ordered by (-value, id)."""
    out = np.empty((len(z), k), np.int64)
    for r, row in enumerate(z):
        t = np.partition(row, len(row) - k)[len(row) - k]
        ids = np.nonzero(row >= t)[0]
        out[r] = ids[np.lexsort((ids, -row[ids]))][:k]
    return out


def _scipy_metrics(zr: np.ndarray, zc: np.ndarray, y: np.ndarray) -> dict:
    """Independent float64 reference: scipy log_softmax of each whole row."""
    out = {"kl": [], "kl_rev": [], "js": [], "nll_ref": [], "top1_ref": [], "top1_cand": []}
    for a, b, t in zip(zr, zc, y):
        lp = log_softmax(a.astype(np.float64))
        lq = log_softmax(b.astype(np.float64))
        p, q = np.exp(lp), np.exp(lq)
        lm = np.logaddexp(lp, lq) - math.log(2)
        out["kl"].append(max(0.0, float(np.sum(p * (lp - lq)))))
        out["kl_rev"].append(max(0.0, float(np.sum(q * (lq - lp)))))
        out["js"].append(max(0.0, 0.5 * float(np.sum(p * (lp - lm))) + 0.5 * float(np.sum(q * (lq - lm)))))
        out["nll_ref"].append(-float(lp[t]))
        out["top1_ref"].append(int(np.argmax(a)))
        out["top1_cand"].append(int(np.argmax(b)))
    return {k: np.asarray(v) for k, v in out.items()}


def test_streamed_compare_equals_unstreamed_metrics(runs):
    """compare in 3-row blocks across item boundaries == scipy on whole rows.

    Tolerance: both sum ~V = 248,320 float64 terms of size <= 1: |error| <= V u64 ~ 5.5e-11
    per sum, a few sums per metric -> 1e-9 absolute."""
    ref, cand = runs
    comp = compare_runs(ref, cand, max_batch_rows=3)
    items = ref.items()
    cand_items = {it.id: it for it in cand.items()}
    zr = np.concatenate([ref.logits(it) for it in items])
    zc = np.concatenate([cand.logits(cand_items[it.id]) for it in items])
    y = np.concatenate([it.next_tokens for it in items])
    want = _scipy_metrics(zr, zc, y)
    c = comp.columns
    assert len(c["kl_nats"]) == len(y)
    np.testing.assert_allclose(c["kl_nats"], want["kl"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(c["kl_rev_nats"], want["kl_rev"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(c["jsd_nats"], want["js"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(c["nll_ref"], want["nll_ref"], rtol=0, atol=1e-9)
    assert np.array_equal(c["top1_ref"], want["top1_ref"]) and np.array_equal(c["top1_cand"], want["top1_cand"])
    assert c["kl_nats"].max() > 0  # bf16 vs float32 of one model: real drift
    # the same comparison in one block per run gives bitwise the same columns
    whole = compare_runs(ref, cand, max_batch_rows=10_000)
    for key in ("kl_nats", "jsd_nats", "kl_topk_nats", "shared_tokens"):
        assert np.array_equal(whole.columns[key], c[key])
    # and the method names the real dtypes
    assert comp.method["reference_dtype"] == "bfloat16" and comp.method["candidate_dtype"] == "float32"


def test_topk_error_streamed_exact_and_approx(runs):
    ref, cand = runs
    res = topk_error(ref, cand, [8, 64, 1024], max_batch_rows=5)
    items = ref.items()
    cand_items = {it.id: it for it in cand.items()}
    zr = np.concatenate([ref.logits(it) for it in items])
    zc = np.concatenate([cand.logits(cand_items[it.id]) for it in items])
    want = _scipy_metrics(zr, zc, np.concatenate([it.next_tokens for it in items]))
    assert res["n"] == len(want["kl"])
    assert abs(res["exact"]["mean"] - want["kl"].mean()) <= 1e-9
    # the K = 1024 approximation straight from the seed's formula on whole rows
    k = 1024
    lp = np.stack([log_softmax(r.astype(np.float64)) for r in zr])
    lq = np.stack([log_softmax(r.astype(np.float64)) for r in zc])
    ir, ic = _top_k(zr, k), _top_k(zc, k)
    t = M.topk(ir, np.take_along_axis(lp, ir, 1), ic, np.take_along_axis(lq, ic, 1), V)
    row = next(r for r in res["rows"] if r["k"] == k)
    assert abs(row["approx_mean"] - t["kl_nats"].mean()) <= 1e-9


def test_live_compare_streams_the_same_numbers(runs, cand32):
    ref, cand = runs
    stored = compare_runs(ref, cand, max_batch_rows=6)
    live = compare_runs(ref, LiveRun(cand32, ref, chunk_bytes=CHUNK), max_batch_rows=6)
    assert np.array_equal(live.columns["kl_nats"], stored.columns["kl_nats"])


class _Spy:
    """A real source whose ``score_blocks`` is watched: the largest block it handed out
    and the rows per pair."""

    def __init__(self, src):
        self._src = src
        self.max_rows = 0
        self.rows_per_pair: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._src, name)

    def score_blocks(self, batch, positions=None, *, chunk_bytes=None):
        for b in self._src.score_blocks(batch, positions, chunk_bytes=chunk_bytes):
            self.max_rows = max(self.max_rows, len(b.rows))
            self.rows_per_pair[b.pair] = self.rows_per_pair.get(b.pair, 0) + len(b.rows)
            yield b


def test_topk_store_and_sampled_positions_never_hold_full_rows(tmp_path, runs, ref16):
    ref, _ = runs
    spy = _Spy(ref16)
    block = rows_per_block(V, CHUNK)
    capture_reference(spy, ITEMS, tmp_path / "s", store="topk:64", positions="sample:0.1:7", chunk_bytes=CHUNK)
    run = RunReader(tmp_path / "s")
    assert spy.max_rows <= block  # never more than a chunk's bytes of float32 rows at once
    for k, it in enumerate(run.items()):
        assert len(it.positions) == math.ceil(0.1 * len(it.teacher_ids))
        assert spy.rows_per_pair[k] == len(it.positions)  # only sampled rows were computed
        assert it.positions == select_positions(len(it.teacher_ids), "sample:0.1:7", it.id)
    assert all(c["data"].endswith(".topk.npz") for c in run.manifest["chunks"])
    # same teacher (greedy, same model) and top-K of the full reference rows at those positions
    full = {it.id: it for it in ref.items()}
    for it in run.items():
        assert it.teacher_ids == full[it.id].teacher_ids
        z = ref.logits(full[it.id])[it.positions]
        st = M.row_stats(z, k=64)
        got = run.topk(it)
        assert np.array_equal(got["ids"], st["topk_ids"])
        np.testing.assert_allclose(got["logprobs"], st["topk_logprobs"], rtol=0, atol=1e-9)
    assert run.manifest["settings"]["positions_sampling"]["seed"] == 7


def test_sampled_report_says_so(tmp_path, runs, ref16, cand32):
    from logitdiff.report import build_report
    from logitdiff.report.markdown import render_markdown

    capture_reference(ref16, ITEMS[:1], tmp_path / "r", positions="sample:0.25", chunk_bytes=CHUNK)
    r = RunReader(tmp_path / "r")
    capture_candidate(cand32, r, tmp_path / "c", store="topk:16", chunk_bytes=CHUNK)
    comp = compare_runs(r, RunReader(tmp_path / "c"))
    report, _ = build_report(comp, n_boot=10)
    pos = report["method"]["positions"]
    assert pos["mode"] == "sample:0.25" and pos["fraction"] == 0.25 and pos["seed"] is None
    md = render_markdown(report)
    assert "sampled: --positions sample:0.25" in md
    assert "P_bfloat16 || P_float32" in report["method"]["description"]
    json.dumps(report, default=str)


def test_batched_left_padded_generation_equals_one_at_a_time(cand32):
    prompts = [cand32.render(it) for it in ITEMS]
    assert len(prompts[0]) != len(prompts[1])  # left padding really happens
    batched = cand32.generate_many(prompts, [40, 25])
    alone = [cand32.generate(p, n) for p, n in zip(prompts, [40, 25])]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert [len(g.token_ids) for g in batched] == [40, 25]
    assert not hasattr(batched[0], "logits")
