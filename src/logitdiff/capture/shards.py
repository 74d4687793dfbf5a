"""Scale-out: sharded captures and merging the shards back into one RUN.

* :func:`parse_shard` / :func:`shard_items` — ``--shard i/n`` keeps the blocks ``k`` of
  ``block`` consecutive items (workload order) with ``k mod n == i``, so n processes (one
  per replica or machine) capture disjoint parts of one workload. ``capture`` uses its
  scoring batch as the block (recorded as setting ``shard_block``), so every item is scored
  with the same batch mates as in an unsharded capture.
* :func:`merge_runs` — joins complete shard RUNs into one RUN after checking that they are
  the same capture (vocabulary, tokenizer, store, settings) of disjoint items; the merged run
  is written to a temporary directory and renamed, so a failed merge leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, overload

from ..errors import LogitdiffError
from ..store.files import Kind, reserved, writing
from ..store import RESUME_FREE_IDENTITY, RunReader, RunWriter

# settings that may differ between shards of one capture
_SHARD_KEYS = {"shard", "endpoint", "endpoints"}


@overload
def parse_shard(text: str) -> tuple[int, int]: ...
@overload
def parse_shard(text: None) -> None: ...
@overload
def parse_shard(text: str | None) -> tuple[int, int] | None: ...


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


def shard_items(items: Sequence, shard: str | tuple[int, int] | None, block: int = 1) -> list:
    """Items at positions ``k`` in ``items`` with ``(k // block) mod n == i``."""
    if shard is None:
        return list(items)
    i, n = parse_shard(shard) if isinstance(shard, str) else shard
    return [it for k, it in enumerate(items) if (k // block) % n == i]


def with_endpoints(spec: str, urls: Sequence[str]) -> str:
    """Add replica URLs (``capture --endpoint URL``, repeatable) to a ``served:`` (or ``openai:``) spec."""
    urls = [u for u in urls if u]
    if not urls:
        return spec
    from ..sources import parse_spec
    from ..sources.options import is_served

    if not is_served(spec):
        raise LogitdiffError(f"--endpoint applies to served: sources only, not {spec!r}")

    sp = parse_spec(spec)
    have = [u for u in sp.options.get("endpoints", "").split("|") if u]
    opts = {**sp.options, "endpoints": "|".join(have + [u for u in urls if u not in have and u != sp.target])}
    return f"{sp.kind}:{sp.target}" + "".join(f",{k}={v}" for k, v in opts.items() if v)


def _comparable_settings(run: RunReader) -> dict:
    return {k: v for k, v in (run.manifest.get("settings") or {}).items() if k not in _SHARD_KEYS}


# identity keys that say where a shard's model was, not what it was: shards run on other
# machines, replicas and paths (the weights' hashes, versions, dtype... must agree)
_PLACE_IDENTITY = {"spec", "model_path", "path", "endpoints", "root", "tokenizer"}


def _comparable_identity(run: RunReader) -> dict:
    """A shard's source identity as ``--resume`` compares it (RESUME_FREE_IDENTITY aside),
    less where the model was; plus the source kind."""
    src = run.manifest.get("source") or {}
    ident = src.get("identity") if isinstance(src, dict) else None
    ident = ident if isinstance(ident, dict) else {}
    keep = {k: v for k, v in ident.items() if k not in RESUME_FREE_IDENTITY and k not in _PLACE_IDENTITY}
    if "device" in keep:  # cuda:0 and cuda:1 compute alike; cpu and cuda do not
        keep["device"] = str(keep["device"]).split(":")[0]
    keep["source.kind"] = src.get("kind") if isinstance(src, dict) else None
    return json.loads(json.dumps(keep, default=str))


def _short(x, limit: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def merge_runs(paths: Sequence[str | Path], out: str | Path, *, overwrite: bool = False, chunk_bytes: int | None = None) -> Path:
    """Merge complete shard runs into ``out``. Refuses partial runs, different vocabularies,
    tokenizers, stores or settings, duplicate items and incomplete shard sets. ``out`` is
    locked for the whole call (re-entered when the caller holds it, as the CLI does): a
    second writer is refused while the shards are checked, not only while they are copied."""
    if len(paths) < 1:
        raise LogitdiffError("merge: give at least one RUN")
    out = Path(out)
    with reserved(out, Kind.RUN, inputs=paths, overwrite=overwrite):
        return _merge_runs(paths, out, overwrite=overwrite, chunk_bytes=chunk_bytes)


def _merge_runs(paths: Sequence[str | Path], out: Path, *, overwrite: bool, chunk_bytes: int | None) -> Path:
    runs = [RunReader(p) for p in paths]  # refuses partial runs
    first = runs[0]
    for r in runs[1:]:
        for field, a, b in (("vocab_size", first.vocab_size, r.vocab_size), ("tokenizer_hash", first.tokenizer_hash, r.tokenizer_hash),
                            ("store", first.store, r.store), ("dtype", first.dtype, r.dtype),
                            ("head", first.manifest.get("head"), r.manifest.get("head"))):
            if a != b:
                raise LogitdiffError(f"{r.path}: field {field!r} is {b!r}, but {a!r} in {first.path}: not shards of one capture")
        ia, ib = _comparable_identity(first), _comparable_identity(r)
        if ia != ib:
            key = next(k for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k))
            raise LogitdiffError(
                f"{r.path}: source identity field {key!r} is {_short(ib.get(key))}, but {_short(ia.get(key))} in "
                f"{first.path}: not shards of one model (merge joins shards of one capture only)"
            )
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
        parsed = [parse_shard(str(s)) for s in shards]
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
    # restore the workload order of i mod n shards: round-robin over shards in shard order,
    # one block of `shard_block` items at a time (1 for runs that do not record it)
    queue = [(runs[k], list(runs[k].items())) for k in order]
    sequence = []
    if all(s is not None for s in shards):
        b = int((first.manifest.get("settings") or {}).get("shard_block") or 1)
        j = 0
        while any(j < len(items) for _, items in queue):
            for r, items in queue:
                sequence += [(r, it) for it in items[j : j + b]]
            j += b
    else:
        sequence = [(r, it) for r, items in queue for it in items]

    with writing(out, Kind.RUN, inputs=paths, overwrite=overwrite) as tmp:
        settings = {k: v for k, v in (first.manifest.get("settings") or {}).items() if k not in _SHARD_KEYS and k not in ("store", "dtype")}
        settings["merged_from"] = [str(r.path) for r in runs]
        src = dict(first.manifest.get("source") or {})
        specs = sorted({(r.manifest.get("source") or {}).get("spec", "") for r in runs})
        if len(specs) > 1:
            src["merged_specs"] = specs
        w = RunWriter(tmp, source=src, vocab_size=first.vocab_size, tokenizer_hash=first.tokenizer_hash, store=first.store,
                      dtype=first.dtype or "float32", settings=settings, vocab=first.vocab(), chunk_bytes=chunk_bytes,
                      **first.kind.writer_args())
        from ..store import RunItem

        try:
            for r, it in sequence:
                ni = RunItem(id=it.id, prompt_ids=it.prompt_ids, teacher_ids=it.teacher_ids, positions=it.positions, tags=it.tags,
                             prompt=it.prompt, extra=it.extra)
                # rows are copied a chunk's span at a time in their stored form, not decoded (bf16
                # bits stay bits; hidden states stay hidden states: every shard has the same head)
                w.begin_item(ni)
                for block in r.stored_blocks(it, w.chunk_rows):
                    w.add_rows(stored=block)
                w.end_item()
            w.finish({"merged": {"runs": [str(r.path) for r in runs], "shards": [s for s in shards if s is not None]}})
        except BaseException:
            try:
                w.close()
            except Exception:
                pass
            raise
    return out

