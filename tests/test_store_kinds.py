"""Store kinds are objects found through a registry: a kind defined in this file alone (one
class, one registry line) is captured, read, compared and merged by the real CLI.

The toy kind keeps each row as int8 codes of a per-row affine grid (``--store int8``):
every stored logit is within half a grid step of the captured one, which bounds how far
its comparisons can be from the full store's exact figures (``_kl_bound``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from scipy.special import log_softmax

from logitdiff.cli import main
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.store.files import atomic_write_bytes
from logitdiff.store import RunReader
from logitdiff.store.kinds import STORE_KINDS, BlockPlace, RowsForm, StoreKind, store_kind
from logitdiff.store.kinds.full import FullStore
from logitdiff.store.kinds.rows import bf16_to_f32

LEVELS = 254  # int8 codes -127..127


class Int8Rows(StoreKind):
    """``--store int8``: row r as ``lo_r + (code + 127) * step_r`` with int8 codes,
    ``step_r = (max_r - min_r) / 254``: V + 16 bytes a row, each logit within step_r / 2."""

    name: ClassVar[str] = "int8"
    usage: ClassVar[str] = "int8"
    reads_as: ClassVar[RowsForm] = RowsForm.FULL
    chunk_suffix: ClassVar[str] = "int8.npz"
    keeps_dtype: ClassVar[bool] = False  # codes, not the source's dtype

    @property
    def row_bytes(self) -> int:
        return int(self.vocab_size or 0) + 16

    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Any:
        z = (bf16_to_f32(rows) if rows.dtype == np.uint16 else np.asarray(rows)).astype(np.float64)
        lo, hi = z.min(1), z.max(1)
        step = np.where(hi > lo, (hi - lo) / LEVELS, 1.0)
        codes = np.rint((z - lo[:, None]) / step[:, None]) - 127
        return {"codes": codes.astype(np.int8), "lo": lo, "step": step}

    def check_block(self, block: Any, place: BlockPlace) -> tuple[Any, int]:
        codes = np.asarray(block["codes"])
        if codes.dtype != np.int8 or codes.ndim != 2 or codes.shape[1] != self.vocab_size or codes.shape[0] > place.n_left:
            raise LogitdiffError(f"{place.where}: int8 codes {codes.dtype} {codes.shape} do not fit")
        return {k: np.asarray(v) for k, v in block.items()}, codes.shape[0]

    def save_chunk(self, path: Path, blocks: list[Any]) -> None:
        V = int(self.vocab_size or 0)
        blocks = blocks or [{"codes": np.zeros((0, V), np.int8), "lo": np.zeros(0), "step": np.zeros(0)}]
        bio = io.BytesIO()
        np.savez(bio, **{k: np.concatenate([b[k] for b in blocks]) for k in ("codes", "lo", "step")})
        atomic_write_bytes(path, bio.getvalue())

    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Any:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in ("codes", "lo", "step")}

    def rows_in(self, block: Any) -> int:
        return int(block["codes"].shape[0])

    def decode(self, block: Any, device: Any = None) -> Any:
        z = block["lo"][:, None] + (block["codes"].astype(np.float64) + 127) * block["step"][:, None]
        return z.astype(np.float32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """builtin:tiny's reference (full store) on ten bundled items, a real llama.cpp Q4_K_M
    candidate, and the reference rerun stored as int8: whole, and in two merged shards."""
    from logitdiff.builtin import WORKLOAD
    from logitdiff.workload import read_workload

    mp = pytest.MonkeyPatch()
    mp.setitem(STORE_KINDS, Int8Rows.name, Int8Rows)  # the registry line
    d = tmp_path_factory.mktemp("kinds")
    wl = d / "wl.jsonl"
    items = read_workload(WORKLOAD)[:10]  # 8 + 2: both shards of --shard i/2 (blocks of 8) hold items
    wl.write_text("".join(json.dumps({**it.to_json(), "max_tokens": 12}) + "\n" for it in items))
    assert main(["capture", "builtin:tiny", "--workload", str(wl), "--out", str(d / "ref")]) == 0
    assert main(["capture", "builtin:tiny-Q4_K_M", "--reference", str(d / "ref"), "--out", str(d / "cand")]) == 0
    assert main(["capture", "builtin:tiny", "--reference", str(d / "ref"), "--store", "int8", "--out", str(d / "int8")]) == 0
    for i in range(2):
        assert main(["capture", "builtin:tiny", "--reference", str(d / "ref"), "--store", "int8", "--shard", f"{i}/2",
                     "--out", str(d / f"int8_{i}")]) == 0
    assert main(["merge", str(d / "int8_1"), str(d / "int8_0"), "--out", str(d / "int8_merged")]) == 0
    yield d
    mp.undo()


def _rows(run: RunReader) -> np.ndarray:
    return np.concatenate([run.logits(it) for it in run.items()]).astype(np.float64)


def _kl_bound(z: np.ndarray, lq: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Per row, how far KL(P'||Q) can be from KL(P||Q) when every logit of P' is within
    eps of P's: log-probabilities move by at most d = 2 eps, so
    |sum p'(a'-a)| <= d and |sum (p'-p)(a-b)| <= (e^d - 1) (max(a-b) - min(a-b)) / 2."""
    d = 2 * eps
    f = log_softmax(z, axis=1) - lq
    return d + np.expm1(d) * (f.max(1) - f.min(1)) / 2


def test_the_registered_kind_is_what_the_run_holds(runs):
    run = RunReader(runs / "int8")
    assert run.store == "int8" and type(run.kind) is Int8Rows and run.manifest["settings"]["dtype"] is None
    assert {p.name.split(".", 1)[1] for p in (runs / "int8" / "chunks").iterdir()} == {"items.jsonl", "int8.npz"}
    assert store_kind("int8").k == 0  # not a top-K store
    with pytest.raises(LogitdiffError, match="expected int8"):
        store_kind("int8:3")


def test_stored_rows_are_within_half_a_step(runs):
    ref, toy = RunReader(runs / "ref"), RunReader(runs / "int8")
    z, zq = _rows(ref), _rows(toy)
    step = (z.max(1) - z.min(1)) / LEVELS
    err = np.abs(zq - z).max(1)
    # half a step, plus the float32 rounding of the decoded value
    assert (err <= step / 2 * (1 + 1e-6) + np.abs(z).max(1) * 2.0**-23).all()
    assert (err > 0).any()  # the toy store is lossy: these are its rows, not a copy of the full store's


def test_compare_is_exact_on_the_stored_rows_and_bounded_against_the_full_store(runs):
    ref, toy, cand = RunReader(runs / "ref"), RunReader(runs / "int8"), RunReader(runs / "cand")
    full, q = compare_runs(ref, cand), compare_runs(toy, cand)
    assert q.kind == "full_vocab" and q.method["bounds"] == "exact" and q.n == full.n > 50
    z, zq, zc = _rows(ref), _rows(toy), _rows(cand)
    lq, lc = log_softmax(zq, axis=1), log_softmax(zc, axis=1)
    # exact on what the toy store holds: float64 scipy on its decoded rows
    kl = (np.exp(lq) * (lq - lc)).sum(1)
    np.testing.assert_allclose(q.columns["kl_nats"], kl, rtol=1e-9, atol=1e-12)
    # and within the bound its encoding gives of the full store's exact figures
    eps = (z.max(1) - z.min(1)) / LEVELS / 2 * (1 + 1e-6) + np.abs(z).max(1) * 2.0**-23
    gap = np.abs(q.columns["kl_nats"] - full.columns["kl_nats"])
    assert (gap <= _kl_bound(z, lc, eps)).all()
    assert gap.max() > 0
    # the reference's winner survives wherever its logit margin exceeds the grid's error
    top2 = -np.sort(-z, 1)[:, :2]
    safe = top2[:, 0] - top2[:, 1] > 2 * eps
    assert safe.sum() > q.n // 2
    assert (q.columns["top1_ref"][safe] == full.columns["top1_ref"][safe]).all()


def test_merged_shards_hold_the_same_rows(runs):
    whole, merged, cand = RunReader(runs / "int8"), RunReader(runs / "int8_merged"), RunReader(runs / "cand")
    assert merged.store == "int8" and [it.id for it in merged.items()] == [it.id for it in whole.items()]
    assert len(RunReader(runs / "int8_1").items()) == 2
    for a, b in zip(whole.items(), merged.items()):
        sa, sb = list(whole.stored_blocks(a)), list(merged.stored_blocks(b))
        for key in ("codes", "lo", "step"):  # copied as stored, bit for bit
            np.testing.assert_array_equal(np.concatenate([s[key] for s in sa]), np.concatenate([s[key] for s in sb]))
    a, b = compare_runs(whole, cand), compare_runs(merged, cand)
    for key in ("kl_nats", "kl_rev_nats", "jsd_nats", "top1_ref"):
        np.testing.assert_array_equal(a.columns[key], b.columns[key])


def test_an_unregistered_store_is_refused_naming_the_registered_ones(monkeypatch):
    monkeypatch.setitem(STORE_KINDS, Int8Rows.name, Int8Rows)
    with pytest.raises(LogitdiffError, match=r"expected full, topk:K .*, hidden or int8$"):
        store_kind("int9")
    monkeypatch.delitem(STORE_KINDS, Int8Rows.name)
    with pytest.raises(LogitdiffError, match="expected full") as e:
        store_kind("int8")
    assert "int8" not in str(e.value).split("expected")[1]


def test_resume_continues_a_killed_capture_of_the_kind(tmp_path, monkeypatch):
    """RunWriter with the registered kind: a capture killed after its first chunk resumes to
    the rows of one written whole; resuming with another store is refused."""
    from logitdiff.store import ResumeMismatch, RunItem, RunWriter

    monkeypatch.setitem(STORE_KINDS, Int8Rows.name, Int8Rows)
    V = 64
    rng = np.random.default_rng(3)
    rows = {f"i{j}": rng.normal(size=(5, V)).astype(np.float32) * 4 for j in range(4)}

    def item(iid):
        return RunItem(id=iid, prompt_ids=[1], teacher_ids=list(range(5)), positions=list(range(5)))

    def writer(path, store="int8", resume=False):
        return RunWriter(path, source={"spec": "test"}, vocab_size=V, tokenizer_hash="sha256:t", store=store, chunk_rows=5,
                         resume=resume)

    whole = writer(tmp_path / "whole")
    for iid, z in rows.items():
        whole.add(item(iid), logits=z)
    whole.finish()
    killed = writer(tmp_path / "run")
    for iid in ("i0", "i1"):
        killed.add(item(iid), logits=rows[iid])
    killed.flush()  # two chunks on disk, then the process dies: no finish
    killed.close()
    with pytest.raises(ResumeMismatch, match="settings.store"):
        writer(tmp_path / "run", store="full", resume=True)
    again = writer(tmp_path / "run", resume=True)
    assert again.done_ids() == {"i0", "i1"}
    for iid in ("i2", "i3"):
        again.add(item(iid), logits=rows[iid])
    again.finish()
    a, b = RunReader(tmp_path / "whole"), RunReader(tmp_path / "run")
    for x, y in zip(a.items(), b.items(), strict=True):
        np.testing.assert_array_equal(a.logits(x), b.logits(y))
        assert np.abs(b.logits(y) - rows[y.id]).max() <= (np.ptp(rows[y.id], 1).max() / LEVELS) / 2 * (1 + 1e-6) + 1e-5


class KeptAsGiven(FullStore):
    """``--store asgiven``: a lossless kind (the full store's files under another name) that
    keeps a source's full rows as given and that ``auto`` prefers to every bundled kind."""

    name: ClassVar[str] = "asgiven"
    usage: ClassVar[str] = "asgiven"
    summary: ClassVar[str] = "the source's rows as it gave them"
    chunk_suffix: ClassVar[str] = "asgiven.npy"
    auto_rank: ClassVar[int] = 5

    @classmethod
    def as_given(cls, top_k: int, vocab_size: int | None, dtype: str | None) -> StoreKind | None:
        return None if top_k else cls(cls.name, vocab_size, dtype)


def test_a_registered_kind_joins_every_list_of_kinds(runs, monkeypatch):
    """Every list of kinds is read from the registry: a kind registered first (one line, no
    other edit) is a choice of run --reference-store, what ``auto`` picks, and what a live
    candidate's rows are held as; unregistered, it is none of them."""
    from logitdiff.capture import LiveRun
    from logitdiff.cli import build_parser
    from logitdiff.sources import open_source
    from logitdiff.store import kinds

    def choices() -> tuple[str, ...]:
        run_p = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
        return next(a.choices for a in run_p._actions if "--reference-store" in a.option_strings)

    ref = RunReader(runs / "ref")
    with open_source("builtin:tiny") as src:
        assert choices() == ("auto", "full", "hidden") and kinds.auto_kind(src) == "hidden"
        assert type(LiveRun(src, ref).kind).__name__ == "FullStore"
        monkeypatch.setattr(kinds, "STORE_KINDS", {KeptAsGiven.name: KeptAsGiven, **kinds.STORE_KINDS})  # the registry line
        assert choices() == ("auto", "asgiven", "full", "hidden")
        assert kinds.auto_kind(src) == "asgiven"
        live = LiveRun(src, ref)
        assert type(live.kind) is KeptAsGiven and live.manifest["settings"]["store"] == "asgiven"
        # read as full rows: compared exactly, the reference against a rerun of itself in the
        # capture's batch layout (bit-identical on CPU: 0 at every position)
        exact = compare_runs(ref, live)
        assert exact.method["bounds"] == "exact" and exact.n == sum(len(it.positions) for it in ref.items()) > 50
        assert not exact.columns["kl_nats"].any() and exact.columns["top1_match"].all()
