"""Scale-out and served-model helpers: sharded captures, merging shards, and measuring the
error of the top-K approximation against exact full-vocabulary KL.

* :func:`parse_shard` / :func:`shard_items` — ``--shard i/n`` keeps items ``k`` with
  ``k mod n == i`` (workload order), so n processes (one per replica or machine) capture
  disjoint parts of one workload.
* :func:`merge_runs` — joins complete shard RUNs into one RUN after checking that they are
  the same capture (vocabulary, tokenizer, store, settings) of disjoint items; the merged run
  is written to a temporary directory and renamed, so a failed merge leaves nothing behind.
* :func:`topk_error` — two full-logit runs: exact KL next to the seed's top-K approximation
  at several K, so the approximation error of a served (top-K) comparison is measured.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from . import metrics as M
from .errors import LogitdiffError
from .store import RunReader, RunWriter, rows_per_block

# settings that may differ between shards of one capture
_SHARD_KEYS = {"shard", "endpoint", "endpoints"}


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"i/n"`` -> (i, n) with 0 <= i < n; None passes through."""
    if text is None:
        return None
    try:
        a, b = str(text).split("/")
        i, n = int(a), int(b)
    except ValueError:
        raise LogitdiffError(f"--shard {text!r}: expected I/N with integers, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise LogitdiffError(f"--shard {text!r}: need N >= 1 and 0 <= I < N")
    return i, n


def shard_items(items: Sequence, shard: str | tuple[int, int] | None) -> list:
    """Items ``k`` (position in ``items``) with ``k mod n == i``."""
    if shard is None:
        return list(items)
    i, n = parse_shard(shard) if isinstance(shard, str) else shard
    return [it for k, it in enumerate(items) if k % n == i]


def shard_pairs(pairs: Sequence, shard: str | tuple[int, int] | None) -> list:
    """The same split for a candidate capture: pairs of :func:`capture.verified_prompts`
    (teacher-run order) with index ``k mod n == i``."""
    return shard_items(pairs, shard)


def with_endpoints(spec: str, urls: Sequence[str]) -> str:
    """Add replica URLs (``capture --endpoint URL``, repeatable) to an ``openai:`` spec."""
    urls = [u for u in urls if u]
    if not urls:
        return spec
    if not spec.startswith("openai:"):
        raise LogitdiffError(f"--endpoint applies to openai: sources only, not {spec!r}")
    from .sources import parse_spec

    sp = parse_spec(spec)
    have = [u for u in sp.options.get("endpoints", "").split("|") if u]
    opts = {**sp.options, "endpoints": "|".join(have + [u for u in urls if u not in have and u != sp.target])}
    return f"openai:{sp.target}" + "".join(f",{k}={v}" for k, v in opts.items() if v)


def _comparable_settings(run: RunReader) -> dict:
    return {k: v for k, v in (run.manifest.get("settings") or {}).items() if k not in _SHARD_KEYS}


def merge_runs(paths: Sequence[str | Path], out: str | Path, *, overwrite: bool = False, chunk_bytes: int | None = None) -> Path:
    """Merge complete shard runs into ``out``. Refuses partial runs, different vocabularies,
    tokenizers, stores or settings, duplicate items and incomplete shard sets."""
    if len(paths) < 1:
        raise LogitdiffError("merge: give at least one RUN")
    out = Path(out)
    if out.exists() and not overwrite:
        raise LogitdiffError(f"{out}: already exists (use --overwrite)")
    runs = [RunReader(p) for p in paths]  # refuses partial runs
    first = runs[0]
    for r in runs[1:]:
        for field, a, b in (("vocab_size", first.vocab_size, r.vocab_size), ("tokenizer_hash", first.tokenizer_hash, r.tokenizer_hash),
                            ("store", first.store, r.store), ("dtype", first.dtype, r.dtype)):
            if a != b:
                raise LogitdiffError(f"{r.path}: field {field!r} is {b!r}, but {a!r} in {first.path}: not shards of one capture")
        sa, sb = _comparable_settings(first), _comparable_settings(r)
        if sa != sb:
            key = next(k for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k))
            raise LogitdiffError(
                f"{r.path}: setting {key!r} is {sb.get(key)!r}, but {sa.get(key)!r} in {first.path}: not shards of one capture"
            )
    # shard bookkeeping, when the runs carry it
    shards = [(r.manifest.get("settings") or {}).get("shard") for r in runs]
    order = list(range(len(runs)))
    if all(s is not None for s in shards):
        parsed = [parse_shard(s) for s in shards]
        ns = {n for _, n in parsed}
        if len(ns) != 1:
            raise LogitdiffError(f"merge: shards of different splits ({', '.join(sorted(set(map(str, shards))))})")
        n = ns.pop()
        got = sorted(i for i, _ in parsed)
        if got != list(range(n)):
            missing = sorted(set(range(n)) - set(got))
            dup = sorted({i for i in got if got.count(i) > 1})
            raise LogitdiffError(
                f"merge: shard set incomplete for N={n}"
                + (f" (missing {', '.join(f'{i}/{n}' for i in missing)})" if missing else "")
                + (f" (duplicate {', '.join(f'{i}/{n}' for i in dup)})" if dup else "")
            )
        order = sorted(range(len(runs)), key=lambda k: parsed[k][0])
    elif any(s is not None for s in shards):
        raise LogitdiffError("merge: some runs carry a shard setting and some do not")
    seen: dict[str, Path] = {}
    for r in runs:
        for it in r.items():
            if it.id in seen:
                raise LogitdiffError(f"merge: item {it.id!r} is in both {seen[it.id]} and {r.path}")
            seen[it.id] = r.path
    # restore the workload order of i mod n shards: round-robin over shards in shard order
    queue = [(runs[k], list(runs[k].items())) for k in order]
    sequence = []
    if all(s is not None for s in shards):
        j = 0
        while any(j < len(items) for _, items in queue):
            for r, items in queue:
                if j < len(items):
                    sequence.append((r, items[j]))
            j += 1
    else:
        sequence = [(r, it) for r, items in queue for it in items]

    tmp = out.with_name(f".{out.name}.merge-tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        settings = {k: v for k, v in (first.manifest.get("settings") or {}).items() if k not in _SHARD_KEYS and k not in ("store", "dtype")}
        settings["merged_from"] = [str(r.path) for r in runs]
        src = dict(first.manifest.get("source") or {})
        specs = sorted({(r.manifest.get("source") or {}).get("spec", "") for r in runs})
        if len(specs) > 1:
            src["merged_specs"] = specs
        w = RunWriter(tmp, source=src, vocab_size=first.vocab_size, tokenizer_hash=first.tokenizer_hash, store=first.store,
                      dtype=first.dtype or "float32", settings=settings, vocab=first.vocab(), chunk_bytes=chunk_bytes)
        from .store import RunItem

        for r, it in sequence:
            ni = RunItem(id=it.id, prompt_ids=it.prompt_ids, teacher_ids=it.teacher_ids, positions=it.positions, tags=it.tags,
                         prompt=it.prompt, extra=it.extra)
            # rows are copied a block at a time in their stored form (bf16 bits stay bits)
            w.begin_item(ni)
            for block in r.row_blocks([it], rows_per_block(first.vocab_size, chunk_bytes), raw=True):
                if r.k:
                    w.add_rows(topk={k: np.asarray(v) for k, v in block.items()})
                else:
                    w.add_rows(logits=block)
            w.end_item()
        w.finish({"merged": {"runs": [str(r.path) for r in runs], "shards": [s for s in shards if s is not None]}})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------------------
# top-K approximation error
# --------------------------------------------------------------------------------------


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise LogitdiffError(f"--k {text!r}: expected comma-separated integers, e.g. 8,20,64,256") from None
    if not ks or ks[0] < 1:
        raise LogitdiffError(f"--k {text!r}: every K must be >= 1")
    return ks


def topk_error(ref: RunReader, cand: RunReader, ks: Sequence[int], *, eps: float = 1e-12, max_batch_rows: int | None = None,
               chunk_bytes: int | None = None) -> dict:
    """Exact KL(P_ref || P_cand) vs the seed's top-K approximation at each K.

    Both runs must hold full logits. Rows stream through in blocks that cross item
    boundaries (``max_batch_rows``, default a chunk of float32 rows); each side's top-kmax is
    taken per block, so memory is a few blocks plus per-position scalars. Returns ``{"n",
    "vocab_size", "exact": {...}, "rows": [{"k", "approx_mean", "approx_p95", "approx_max",
    "mean_abs_err", "max_abs_err", "rel_err_of_mean", "median_rel_err", "top1_agreement", ...}]}``.
    """
    from .compare import check_comparable

    if ref.k or cand.k:
        raise LogitdiffError(f"topk-error needs two full-logit runs ({ref.path if ref.k else cand.path} stores top-{ref.k or cand.k})")
    items_r, items_c, _ = check_comparable(ref, cand)
    V = ref.vocab_size
    ks = [k for k in ks]
    over = [k for k in ks if k > V]
    if over:
        raise LogitdiffError(f"--k {over[0]} exceeds the vocabulary size {V}")
    kmax = max(ks)
    if max_batch_rows is None:
        max_batch_rows = rows_per_block(V, chunk_bytes)
    exact, top1 = [], []
    approx: dict[int, list] = {k: [] for k in ks}
    approx_top1: dict[int, list] = {k: [] for k in ks}
    top_mass: dict[int, list] = {k: [] for k in ks}
    for zr, zc in zip(ref.row_blocks(items_r, max_batch_rows), cand.row_blocks(items_c, max_batch_rows)):
        # exact metrics and each side's top-kmax from one pass; every prefix is the top-k
        m = M.full_vocab(zr, zc, k=min(10, V), top_k_out=kmax)
        exact.append(m["kl_nats"])
        top1.append(m["top1_match"])
        ir, lr, ic, lc = m["topk_ids_ref"], m["topk_logprobs_ref"], m["topk_ids_cand"], m["topk_logprobs_cand"]
        for k in ks:
            t = M.topk(ir[:, :k], lr[:, :k], ic[:, :k], lc[:, :k], V, eps=eps)
            approx[k].append(t["kl_nats"])
            approx_top1[k].append(t["top1_match"])
            top_mass[k].append(t["baseline_top_mass"])
    ex = np.concatenate(exact) if exact else np.zeros(0)
    t1 = np.concatenate(top1) if top1 else np.zeros(0, bool)
    if ex.size == 0:
        raise LogitdiffError(f"{ref.path} and {cand.path}: no positions to compare")

    def stats(x):
        return {"mean": float(x.mean()), "p95": float(np.percentile(x, 95)), "max": float(x.max())}

    out_rows = []
    for k in ks:
        a = np.concatenate(approx[k])
        err = a - ex
        nz = ex > 1e-12
        rel = np.abs(err[nz]) / ex[nz] if nz.any() else np.zeros(0)
        s = stats(a)
        out_rows.append({
            "k": k,
            "approx_mean": s["mean"],
            "approx_p95": s["p95"],
            "approx_max": s["max"],
            "mean_abs_err": float(np.abs(err).mean()),
            "max_abs_err": float(np.abs(err).max()),
            "mean_signed_err": float(err.mean()),
            "rel_err_of_mean": float(abs(a.mean() - ex.mean()) / ex.mean()) if ex.mean() > 0 else 0.0,
            "median_rel_err": float(np.median(rel)) if rel.size else 0.0,
            "top1_agreement": float(np.concatenate(approx_top1[k]).mean()),
            "ref_top_mass_mean": float(np.concatenate(top_mass[k]).mean()),
        })
    return {
        "reference": str(ref.path),
        "candidate": str(cand.path),
        "n": int(ex.size),
        "items": len(items_r),
        "vocab_size": int(V),
        "epsilon": eps,
        "method": "seed top-K approximation (metrics.topk) vs exact full-vocabulary KL (metrics.full_vocab), nats",
        "exact": {**stats(ex), "top1_agreement": float(t1.mean())},
        "rows": out_rows,
    }
