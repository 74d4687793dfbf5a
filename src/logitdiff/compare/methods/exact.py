"""Full rows on both sides: the exact full-vocabulary comparison (``method.bounds`` "exact"),
and the same for an imported llama.cpp ``--kl-divergence-base`` reference, whose quantised
log-probabilities give each divergence a proven interval ("llamacpp-base-bounded")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ...numerics import metrics as M
from ...numerics.bounds import METHOD_EXACT, METHOD_LLAMACPP
from ...contracts import MethodKind
from ...errors import LogitdiffError
from ...store import RunReader, aligned_blocks, bf16_to_f32
from ...store.kinds import RowsForm
from .base import ComparisonMethod, form_of, owner, paired, tops_columns

FULL_DESCRIPTION = (
    "Exact KL(P_ref || P_cand), reverse KL and Jensen-Shannon divergence over the full vocabulary, "
    "in float64 after log_softmax of the captured logits, per teacher-forced output position. "
    "The seed's top-K fields (top masses, shared tokens) are computed from the full logits at "
    "K = top_logprobs, and kl_topk_nats is the top-K approximation of the same position."
)
LLAMACPP_BOUNDS = (
    " The reference is an imported llama.cpp --kl-divergence-base file: its log-probabilities are "
    "uint16-quantised with a floor at max - 16 nats, so each divergence carries a proven interval "
    "[*_lower_nats, *_upper_nats] from the quantisation step and the floor (docs/bounds.md, section 4); "
    "reverse KL has no finite upper bound (floored entries may have p -> 0). The reference's figures are "
    "those of the distribution inside the stored rows' bounds closest to the candidate, so each divergence "
    "is its interval's lower end."
)
LLAMACPP_IMPORT = "llamacpp-kld"  # settings.imported_from of a RUN imported from a llama.cpp base file


def float32_rows(z: np.ndarray) -> np.ndarray:
    """A raw row block (bf16 bits as uint16, or a float array) as float32 values."""
    return bf16_to_f32(z) if z.dtype == np.uint16 else np.asarray(z, np.float32)


def kernel_pair(zr: np.ndarray, zc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two raw row blocks as `metrics.full_vocab` reads them in place: bf16 bits as bfloat16
    views (no float32 copy) when both sides hold the same dtype; float32 copies of the
    block when the dtypes differ (the compiled kernel reads one dtype for both sides)."""
    if zr.dtype == zc.dtype:
        a, b = (M.bfloat16_view(z) if z.dtype == np.uint16 else z for z in (zr, zc))
        return a, b
    return float32_rows(zr), float32_rows(zc)


class Exact(ComparisonMethod):
    """Full rows on both sides: every figure exact, in float64."""

    kind: ClassVar[str] = MethodKind.FULL_VOCAB
    bounds: ClassVar[str] = METHOD_EXACT

    @classmethod
    def fits(cls, ref: Any, cand: Any) -> bool:
        return form_of(ref) is RowsForm.FULL and form_of(cand) is RowsForm.FULL

    def blocks(self, rows: int) -> Iterator[tuple[Any, Any]]:
        # stored dtype as is (bf16 bits stay uint16): the kernel reads them in place, from
        # views of both RUNs' chunks (no concatenation), or a live candidate's blocks
        # re-cut next to the reference's
        from ...capture import LiveRun  # here: the CLI's start imports compare, not the capture stage

        ref, cand = self.ref, self.cand
        if isinstance(ref, RunReader) and (isinstance(cand, RunReader) or (isinstance(cand, LiveRun) and not cand.k)):
            # a RUN's pieces are views of its chunks; a live candidate's are the blocks its
            # source made (one decode each, made ahead while this side computes)
            return aligned_blocks(ref.row_pieces(self.items_r), cand.row_pieces(self.items_c), rows)
        return paired(ref.row_blocks(self.items_r, rows, raw=True), cand.row_blocks(self.items_c, rows, raw=True))

    def rows_in(self, ref_block: Any, cand_block: Any) -> int:
        return len(ref_block)

    def columns(self, ref_block: Any, cand_block: Any, next_tokens: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        V = self.V
        try:
            m = M.full_vocab(*kernel_pair(ref_block, cand_block), next_tokens, k=int(self.overlap_k or 0), top_k_out=self.top_k,
                             device=self.device, threads=self.threads)
        except M.NonFiniteLogits as e:
            it, row = owner(self.items_r, row0 + e.row)
            run = self.ref if e.side == "reference" else self.cand
            raise LogitdiffError(f"{run.path}: item {it.id!r} has NaN/inf logits at output position {it.positions[row]}") from None
        ir, lr = m.pop("topk_ids_ref"), m.pop("topk_logprobs_ref")
        ic, lc = m.pop("topk_ids_cand"), m.pop("topk_logprobs_cand")
        out = dict(m)
        # the seed's top-K fields from the same pass (no second log-softmax per side)
        t = M.topk(ir, lr, ic, lc, V, eps=self.eps)
        for key in ("reference_top_mass", "candidate_top_mass", "shared_tokens", "shared_reference_mass", "shared_candidate_mass"):
            out[key] = t[key]
        out["kl_topk_nats"] = t["kl_nats"]
        out.update(tops_columns(ir, lr, ic, lc))
        return out

    def description(self) -> str:
        return FULL_DESCRIPTION


class LlamaCppBounded(Exact):
    """An imported llama.cpp base file against full rows. The base knows each reference
    log-probability only up to its quantisation step, and the floored entries only from
    above; the reference read is the distribution inside those boxes closest to the
    candidate (`bounds.llamacpp_compare`): every column comes from it, so each divergence
    is its interval's lower end and the reference's figures (top-1, entropy, teacher
    token) describe one distribution. A candidate that is itself an imported base is read
    as its rows' own distribution (`bounds.llamacpp_placement`)."""

    bounds: ClassVar[str] = METHOD_LLAMACPP

    @classmethod
    def fits(cls, ref: Any, cand: Any) -> bool:
        return super().fits(ref, cand) and imported_from_llamacpp(ref)

    def columns(self, ref_block: Any, cand_block: Any, next_tokens: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        from ...numerics import bounds as Bd
        from ...store.compact import INTERVAL_COLUMNS, log_softmax

        zr, zc = float32_rows(ref_block), float32_rows(cand_block)
        if not np.isfinite(zc).all():  # the exact path names the row
            return super().columns(ref_block, cand_block, next_tokens, row0)
        cand_base = imported_from_llamacpp(self.cand)
        # both sides float64 when the candidate is read from a base (its rows sit on box
        # edges that float32 would move by ~1e-6 nats); else the reference read in float32,
        # like any capture, beside the candidate as stored
        ref_rows = np.empty(zr.shape, np.float64 if cand_base else np.float32)
        cand_rows = np.empty(zc.shape, np.float64) if cand_base else zc
        step = max(1, (32 << 20) // (max(1, zr.shape[1]) * 8))
        parts: dict[str, list[np.ndarray]] = {}
        for a in range(0, zr.shape[0], step):
            sl = slice(a, a + step)
            codes, scale, mn = Bd.llamacpp_from_logp(zr[sl])
            if cand_base:
                cand_rows[sl] = Bd.llamacpp_placement(*Bd.llamacpp_from_logp(zc[sl]), np.asarray(zc[sl], np.float64))
                lq = cand_rows[sl]
            else:
                lq = log_softmax(np.asarray(zc[sl]))
            lp, ivs = Bd.llamacpp_compare(codes, scale, mn, lq)
            ref_rows[sl] = lp
            for name, (lo, hi) in INTERVAL_COLUMNS.items():
                iv = ivs[name[: -len("_nats")]]
                parts.setdefault(name, []).append(iv.estimate)
                parts.setdefault(lo, []).append(iv.lower)
                parts.setdefault(hi, []).append(iv.upper)
        out = super().columns(ref_rows, cand_rows, next_tokens, row0)
        out.update({k: np.concatenate(v) for k, v in parts.items()})
        return out

    def description(self) -> str:
        return FULL_DESCRIPTION + LLAMACPP_BOUNDS


def imported_from_llamacpp(run: Any) -> bool:
    """Whether a run is an imported llama.cpp base file (settings.imported_from)."""
    manifest = getattr(run, "manifest", None) or {}
    return (manifest.get("settings") or {}).get("imported_from") == LLAMACPP_IMPORT
