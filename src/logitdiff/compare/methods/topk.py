"""Top-K lists on at least one side: the seed's top-K estimate of each divergence, with a
proven interval (``method.bounds`` "topk-bounded"; docs/bounds.md, section 3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ...numerics import metrics as M
from ...numerics.bounds import METHOD_TOPK
from ...contracts import MethodKind
from ...errors import LogitdiffError
from ...store import rows_per_block
from ...store.kinds import RowsForm
from .base import ComparisonMethod, form_of, owner, paired, run_dtype, tops_columns

TOPK_DESCRIPTION = (
    "Approximate KL(P_{ref} || P_{cand}) over next-token top-K distributions. Missing candidate "
    "top-K tokens receive candidate tail_mass/(vocab_size - K). A single explicit tail bucket is included."
)
TOPK_BOUNDS = (
    " Each divergence also carries a proven interval [*_lower_nats, *_upper_nats] "
    "(docs/bounds.md): the lower bound by data processing over the shared tokens; the upper "
    "bound of forward and reverse KL is inf: nothing bounds a probability outside the top-K lists "
    "from below (no logit floor is known)."
)
TOPK_BOUNDS_FLOOR = (
    " Each divergence also carries a proven interval [*_lower_nats, *_upper_nats] "
    "(docs/bounds.md): the lower bound by data processing over the shared tokens; the upper "
    "bound of forward and reverse KL from the stated log-probability floor (--logprob-floor "
    "{floor:g} nats on every entry of both distributions, method.logprob_floor_nats): it holds "
    "only as far as that statement does."
)


def topk_description(ref: Any, cand: Any) -> str:
    """The seed's method text, naming what the two sides really are (not always bf16 vs a quant)."""
    return TOPK_DESCRIPTION.format(ref=run_dtype(ref), cand=run_dtype(cand))


def prob_of(ids: np.ndarray, logprobs: np.ndarray, tok: np.ndarray) -> np.ndarray:
    """Probability of ``tok`` per row where it is in the row's top-K list; NaN otherwise."""
    hit = ids == tok[:, None]
    p = np.where(hit, np.exp(logprobs), 0.0).sum(1)
    return np.where(hit.any(1), p, np.nan)


def check_above_floor(floor: float, sides: Any, row0: int) -> None:
    """Every listed log-probability of both sides is at or above the stated floor (one
    below it proves the statement false, and with it the upper bounds)."""
    for run, items, ids, logp in sides:
        below = (np.asarray(ids) >= 0) & (np.asarray(logp) < floor)
        if below.any():
            r, j = (int(x[0]) for x in np.nonzero(below))
            it, row = owner(items, row0 + r)
            raise LogitdiffError(f"{run.path}: item {it.id!r} position {it.positions[row]}: log-probability "
                                 f"{float(logp[r, j]):.4f} of token {int(ids[r, j])} is below --logprob-floor {floor}")


class TopKBounded(ComparisonMethod):
    """Top-K lists on one side or both (full rows on the other are reduced to their exact
    top-K, a block at a time): the seed's estimate and proven intervals."""

    kind: ClassVar[str] = MethodKind.TOP_K
    bounds: ClassVar[str] = METHOD_TOPK
    takes_floor: ClassVar[bool] = True

    @classmethod
    def fits(cls, ref: Any, cand: Any) -> bool:
        forms = {form_of(ref), form_of(cand)}
        return RowsForm.TOPK in forms and forms <= {RowsForm.TOPK, RowsForm.FULL}

    def __init__(self, ref: Any, cand: Any, items_r: Any, items_c: Any, **kw: Any) -> None:
        super().__init__(ref, cand, items_r, items_c, **kw)
        # K of the top-K fields: what the top-K side(s) stored
        self.top_k = min([x.kind.k for x in (ref, cand) if x.kind.k] + [self.V])
        self.overlap_k = None

    def batch_rows(self, chunk_bytes: int | None) -> int:
        # two top-K stores: a block of K ids + logprobs per row (any K up to V in bounded
        # memory); full rows on either side: a block of V float32 values per row
        if self.ref.kind.k and self.cand.kind.k:
            return rows_per_block(self.top_k, chunk_bytes, 16)
        return super().batch_rows(chunk_bytes)

    def _side(self, run: Any, items: Any, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids [r, k], logprobs [r, k]) blocks of one side: stored top-K sliced to k, or the
        exact top-k of full rows, reduced a block at a time."""
        k = self.top_k
        for b in run.row_blocks(items, rows):
            if form_of(run) is RowsForm.TOPK:
                yield b["ids"][:, :k], b["logprobs"][:, :k]
            else:
                st = M.row_stats(b, k=k, threads=self.threads)
                yield st["topk_ids"], st["topk_logprobs"]

    def blocks(self, rows: int) -> Iterator[tuple[Any, Any]]:
        return paired(self._side(self.ref, self.items_r, rows), self._side(self.cand, self.items_c, rows))

    def rows_in(self, ref_block: Any, cand_block: Any) -> int:
        return len(ref_block[0])

    def columns(self, ref_block: Any, cand_block: Any, next_tokens: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        from ...numerics import bounds as Bd
        from ...store.compact import INTERVAL_COLUMNS

        (ir, lr), (ic, lc) = ref_block, cand_block
        floor = self.logprob_floor
        try:
            t = M.topk(ir, lr, ic, lc, self.V, eps=self.eps)
        except ValueError as e:
            raise LogitdiffError(f"{self.ref.path} vs {self.cand.path}: {e}") from None
        if floor is not None:
            check_above_floor(floor, ((self.ref, self.items_r, ir, lr), (self.cand, self.items_c, ic, lc)), row0)
        out = {key: v for key, v in t.items() if key != "kl_bits"}
        # proven intervals next to the seed's estimate (docs/bounds.md, section 3)
        ivs = Bd.topk_vs_topk(ir, lr, ic, lc, self.V, floor_logp_ref=floor, floor_logp_cand=floor)
        for name, (lo, hi) in INTERVAL_COLUMNS.items():
            iv = ivs[name[: -len("_nats")]]
            out[lo] = iv.lower
            out[hi] = iv.upper
        # the seed's estimate clipped into its interval: where the two are equal in exact
        # arithmetic the seed's float64 sum can fall ~1e-14 below the lower end. Two identical
        # rows (a run against itself, a bit-identical rerun) are exactly 0 and their interval's
        # lower end too: the bound's own rounding (~1e-17) must not lift a zero floor.
        same = np.all(ir == ic, axis=1) & np.all(lr == lc, axis=1)
        out["kl_nats"] = np.where(same, 0.0, ivs["kl"].estimate)
        for lo, _ in INTERVAL_COLUMNS.values():
            out[lo] = np.where(same, 0.0, out[lo])
        # token metrics where the teacher token is inside a top-K set; NaN otherwise
        p_ref = prob_of(ir, lr, next_tokens)
        p_cand = prob_of(ic, lc, next_tokens)
        out["p_ref_token"] = p_ref
        out["p_cand_token"] = p_cand
        out["delta_p"] = p_cand - p_ref
        out["nll_ref"] = -np.log(p_ref)
        out["nll_cand"] = -np.log(p_cand)
        top2 = np.sort(np.exp(lr), axis=1)[:, ::-1]
        out["margin_ref"] = top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0.0)
        out.update(tops_columns(ir, lr, ic, lc))
        return out

    def description(self) -> str:
        floor = self.logprob_floor
        return topk_description(self.ref, self.cand) + (TOPK_BOUNDS if floor is None else TOPK_BOUNDS_FLOOR.format(floor=floor))
