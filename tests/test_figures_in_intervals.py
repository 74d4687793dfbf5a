"""Every reported divergence lies inside its own proven interval, for every comparison method
(compare.methods.METHODS) and every store kind (store.kinds.STORE_KINDS), on real rows:
the bundled trained model (transformers, BF16) as the reference in each store kind, its
llama.cpp Q4_K_M quant as the candidate, and a llama.cpp ``--kl-divergence-base`` file of
the same model's logits, imported.

The base file: llama-perplexity is not built on the test machines, so the file is written by
`importers.write_llamacpp_kld`, which reproduces llama-perplexity's layout and float32
arithmetic (magic, n_ctx/n_vocab/n_chunk, the tokens, then per scored position float32
scale and min_log_prob and V uint16 codes round((z - mn)/scale), mn = max(min z, max z - 16);
tests/test_importers.py checks the bytes), from the bundled model's own logits over the
bundled workload's tokens. The figures are the method's own; the test reads them from
compare_runs' columns and from the summary a report prints.

Issue 40: against an imported base the mean KL was the exact KL of the dequantised rows
renormalised, whose floored entries (each e^min_log_prob) put mass where the candidate has
almost none: 0.546 against an interval of [0.338, 0.345] on Gemma 3.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax, rel_entr

from logitdiff.builtin import WORKLOAD
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.compare import compare_runs
from logitdiff.compare.methods import METHODS, select_method
from logitdiff.errors import LogitdiffError
from logitdiff.numerics.bounds import METHOD_EXACT
from logitdiff.sources import open_source
from logitdiff.store import RunItem, RunReader, RunWriter, bf16_to_f32
from logitdiff.store.compact import INTERVAL_COLUMNS
from logitdiff.store.importers import import_llamacpp_kld, write_llamacpp_kld
from logitdiff.store.kinds import STORE_KINDS
from logitdiff.workload import read_workload

# one --store text per registered kind: a kind added to the registry fails
# test_every_store_kind_has_a_spelling_here until it is compared here too
SPELLING = {"full": "full", "topk": "topk:16", "compact": "compact:exact=16,band=48", "hidden": "hidden"}
REFERENCE = "builtin:tiny"  # transformers, BF16: the only source that fills every kind (hidden needs the head)
CANDIDATE = "builtin:tiny-Q4_K_M"  # llama.cpp in process
N_CTX = 48  # base file chunks: the second half of each is scored
SHARPEN = 4.0  # temperature 1/4: most of each row falls under the -16-nat floor


def _rows_of(run: RunReader, item) -> np.ndarray:
    z = run.logits(item)
    return (bf16_to_f32(z) if z.dtype == np.uint16 else np.asarray(z)).astype(np.float64)


def _rows(run: RunReader) -> np.ndarray:
    return np.concatenate([_rows_of(run, it) for it in run.items()])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """References in every kind, candidates in every kind a candidate source can fill, and an
    imported base with its candidate; keyed ("ref"|"cand", kind) and ("base", "ref"|"cand")."""
    root = tmp_path_factory.mktemp("intervals")
    items = read_workload(WORKLOAD)[:6]
    ref_src, cand_src = open_source(REFERENCE), open_source(CANDIDATE)
    out: dict[tuple[str, str], RunReader] = {}
    for kind, spec in SPELLING.items():
        out[("ref", kind)] = RunReader(capture_reference(ref_src, items, root / f"ref-{kind}", store=spec, max_tokens=24))
    teacher = out[("ref", "full")]
    for kind, spec in SPELLING.items():
        # a GGUF source has no output head to fill the hidden store: the same BF16 model then
        src = ref_src if kind == "hidden" else cand_src
        out[("cand", kind)] = RunReader(capture_candidate(src, teacher, root / f"cand-{kind}", store=spec))
    out[("base", "ref")], out[("base", "cand")], out[("base", "exact")] = _imported_base(root, ref_src, cand_src, items)
    out[("sharp", "ref")], out[("sharp", "cand")], out[("sharp", "exact")] = _sharpened(root, out[("base", "cand")],
                                                                                       out[("base", "exact")])
    return out


def _sharpened(root, cand: RunReader, zp: np.ndarray):
    """Both models' rows of the base at temperature 1/SHARPEN, as a base file and a full
    candidate RUN: the bundled model's rows span ~20 nats, so 1.5 % of a row sits at the
    floor; a trained 262,144-token model's span more (96.6 % for Gemma 3 270M, issue 40)."""
    n_chunk = len(cand.items())
    first = N_CTX // 2
    V = zp.shape[1]
    z = np.zeros((n_chunk, N_CTX, V), np.float32)
    z[:, first : N_CTX - 1] = (zp * SHARPEN).reshape(n_chunk, -1, V)
    tokens = np.array([it.prompt_ids + it.teacher_ids for it in cand.items()], np.int64)
    write_llamacpp_kld(root / "sharp.kld", z, tokens)
    base = RunReader(import_llamacpp_kld(root / "sharp.kld", root / "sharp"))
    w = RunWriter(root / "sharp-cand", source={"spec": "test:sharpened"}, vocab_size=V, tokenizer_hash=None, store="full")
    for it in cand.items():
        w.add(RunItem(id=it.id, prompt_ids=it.prompt_ids, teacher_ids=it.teacher_ids, positions=it.positions),
              logits=(_rows_of(cand, it) * SHARPEN).astype(np.float32))
    w.finish()
    return base, RunReader(root / "sharp-cand"), z[:, first : N_CTX - 1].reshape(-1, V).astype(np.float64)


def _imported_base(root, ref_src, cand_src, items):
    """A base file of the reference model's logits over the workload's tokens, imported, and
    the candidate captured on it; and the base's unquantised rows (for the exact figure)."""
    tokens = np.concatenate([np.asarray(ref_src.render(it), np.int64) for it in items])
    n_chunk = min(3, len(tokens) // N_CTX)
    assert n_chunk >= 2, len(tokens)
    tokens = tokens[: n_chunk * N_CTX].reshape(n_chunk, N_CTX)
    first = N_CTX // 2
    V = len(ref_src.token_texts())
    z = np.zeros((n_chunk, N_CTX, V), np.float32)
    for c in range(n_chunk):
        rows = ref_src.score(tokens[c, : first + 1].tolist(), tokens[c, first + 1 :].tolist())
        z[c, first : N_CTX - 1] = bf16_to_f32(rows) if rows.dtype == np.uint16 else rows
    write_llamacpp_kld(root / "base.kld", z, tokens)
    base = RunReader(import_llamacpp_kld(root / "base.kld", root / "base"))
    cand = RunReader(capture_candidate(cand_src, base, root / "base-cand"))
    return base, cand, z[:, first : N_CTX - 1].reshape(-1, V).astype(np.float64)


def _pairs(runs):
    """Every (reference, candidate) pair of the fixture: each kind against each kind, and
    the imported base against its candidate."""
    for rk in SPELLING:
        for ck in SPELLING:
            yield f"{rk} vs {ck}", runs[("ref", rk)], runs[("cand", ck)]
    yield "llama.cpp base vs full", runs[("base", "ref")], runs[("base", "cand")]
    yield "sharpened llama.cpp base vs full", runs[("sharp", "ref")], runs[("sharp", "cand")]


def assert_inside(comp, label):
    """Each divergence figure inside its interval, row by row and in the mean (the figure a
    report prints), or, for the exact method, no interval because the bounds coincide."""
    col = comp.columns
    assert comp.n > 0, label
    if comp.method["bounds"] == METHOD_EXACT:
        assert not any(lo in col for lo, _ in INTERVAL_COLUMNS.values()), label
        return
    shown = [name for name in INTERVAL_COLUMNS if name in col]
    assert "kl_nats" in shown, label
    for name in shown:  # top-K comparisons report KL only; the others' intervals stand alone
        lo, hi = INTERVAL_COLUMNS[name]
        fig, low, up = (np.asarray(col[k], np.float64) for k in (name, lo, hi))
        assert np.isfinite(fig).all() and (fig >= 0).all(), (label, name)
        bad = np.nonzero(~((low <= fig) & (fig <= up)))[0]
        assert bad.size == 0, f"{label} {name}: row {bad[:1]} figure {fig[bad[:1]]} outside [{low[bad[:1]]}, {up[bad[:1]]}]"
        assert low.mean() <= fig.mean() <= up.mean(), (label, name)


def test_every_store_kind_has_a_spelling_here():
    assert set(SPELLING) == set(STORE_KINDS)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_every_method_reports_figures_inside_their_intervals(runs, method):
    compared = 0
    for label, ref, cand in _pairs(runs):
        try:
            chosen = select_method(ref, cand)
        except LogitdiffError:
            continue
        if chosen is not method:
            continue
        comp = compare_runs(ref, cand, top_logprobs=8, chunk_bytes=1 << 20)
        assert comp.method["bounds"] == method.bounds, label
        assert_inside(comp, label)
        compared += 1
    assert compared, f"no pair of store kinds is compared by {method.__name__}"


@pytest.mark.parametrize("kind", list(SPELLING))
def test_every_store_kind_is_compared_inside_its_intervals_or_refused(runs, kind):
    """A kind on either side: compared with figures inside their intervals, or refused with a
    one-line error naming a run; as a reference, at least one candidate kind is accepted."""
    accepted = 0
    for label, ref, cand in _pairs(runs):
        if kind not in (ref.kind.name, cand.kind.name):
            continue
        try:
            comp = compare_runs(ref, cand, top_logprobs=8)
        except LogitdiffError as e:
            assert len(str(e).splitlines()) == 1 and ("store" in str(e) or "method" in str(e)), (label, str(e))
            continue
        assert_inside(comp, label)
        accepted += ref.kind.name == kind
    assert accepted, f"no candidate kind is accepted against a {kind} reference"


@pytest.mark.parametrize("which", ["base", "sharp"])
def test_imported_base_figure_is_inside_and_near_the_exact_value(runs, which):
    """The imported base: the interval holds the exact KL of the unquantised rows, the
    figure is its lower end, and on rows that reach the floor the old reading (the stored
    rows renormalised) was not a value of the interval."""
    base, cand, zp = runs[(which, "ref")], runs[(which, "cand")], runs[(which, "exact")]
    comp = compare_runs(base, cand)
    col = comp.columns
    lp, lq = log_softmax(zp, 1), log_softmax(_rows(cand), 1)
    p, q = np.exp(lp), np.exp(lq)
    exact = {"kl": rel_entr(p, q).sum(1), "kl_rev": rel_entr(q, p).sum(1),
             "jsd": 0.5 * (rel_entr(p, (p + q) / 2).sum(1) + rel_entr(q, (p + q) / 2).sum(1))}
    for name, ex in exact.items():
        tol = 1e-9 * (1 + ex)
        assert (col[f"{name}_lower_nats"] <= ex + tol).all() and (ex <= col[f"{name}_upper_nats"] + tol).all(), name
        np.testing.assert_array_equal(col[f"{name}_nats"], col[f"{name}_lower_nats"])
    kl = col["kl_nats"].mean()
    assert abs(kl - exact["kl"].mean()) <= 0.05 * exact["kl"].mean() + 1e-6, (kl, exact["kl"].mean())
    # the stored rows as a distribution of their own (what compare read before issue 40)
    stored = log_softmax(_rows(base), 1)
    old = (np.exp(stored) * (stored - lq)).sum(1)
    floored = (_rows(base) == _rows(base).min(1, keepdims=True)).mean()
    if which == "sharp":
        assert floored > 0.5, floored  # most of each row at the -16-nat floor
        assert old.mean() > col["kl_upper_nats"].mean(), (old.mean(), col["kl_upper_nats"].mean())
    # the reference's own figures are those of the distribution it was read as: entropy
    # within the floor's reach of the unquantised rows' entropy, not lifted by the floor
    ent = -(p * lp).sum(1)
    assert np.abs(col["entropy_ref"] - ent).max() < np.abs(-(np.exp(stored) * stored).sum(1) - ent).max()


def test_an_imported_base_against_itself_is_zero(runs):
    base = runs[("base", "ref")]
    comp = compare_runs(base, base)
    for name in INTERVAL_COLUMNS:
        assert (comp.columns[name] == 0).all(), name
    assert comp.columns["top1_match"].all()
