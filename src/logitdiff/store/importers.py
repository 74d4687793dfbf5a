"""Importers: turn other tools' logit dumps into RUN directories.

* ``llamacpp-kld``: the file ``llama-perplexity --kl-divergence-base FILE`` writes:

      "_logits_"              8 bytes
      n_ctx, n_vocab, n_chunk int32 each
      tokens                  int32 [n_chunk * n_ctx]
      per chunk, for each of the n_ctx - 1 - n_ctx/2 scored positions, a row of
      nv = 2*((n_vocab + 1)/2) + 4 uint16: float32 scale, float32 min_log_prob, then
      n_vocab uint16 q with log p = scale * q + min_log_prob

  Only the second half of each chunk is scored: with first = n_ctx/2, row i of a chunk
  holds the distribution after tokens[0 .. first+i] that predicts tokens[first+1+i]. Each
  chunk becomes one item whose prompt is tokens[0 .. first] (the first half plus the
  first scored token's context) and whose teacher sequence is tokens[first+1 ..], so a
  candidate scored on the RUN sees exactly the context llama.cpp's candidate pass sees.
  llama.cpp replaces token 0 of each chunk by BOS when the model adds BOS; pass
  ``bos_id`` to reproduce that. The stored values are log-probabilities quantised to 16
  bits (floored at max - 16 nats); they are stored as float32 "logits" and renormalised
  by log_softmax like any other capture.

* ``npz``: ``logits [N, V]``, ``token_ids [N]`` (the teacher token each row predicts),
  ``item_ids [N]`` and ``positions [N]`` (output position of each row).
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from . import validate
from ..errors import LogitdiffError
from . import npzinflate
from .files import Kind, open_input, reserved, writing
from . import RunItem, RunWriter

MAGIC = b"_logits_"


def read_kld_header(path: Path) -> tuple[int, int, int]:
    # a regular file (a FIFO would hang here); memory-mapped after, so its size (checked
    # against the header below) allocates nothing
    with open_input(path, max_bytes=1 << 62) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(20)
    if len(head) < 20 or head[:8] != MAGIC:
        raise LogitdiffError(f"{path}: not a llama.cpp --kl-divergence-base file (no '_logits_' header)")
    n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[8:20])
    if n_ctx < 2 or n_vocab < 1 or n_chunk < 1:
        raise LogitdiffError(f"{path}: implausible header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    want = 20 + 4 * n_ctx * n_chunk + 2 * nv * n_scored * n_chunk
    if size < want:
        have_chunks = max(0, (size - 20 - 4 * n_ctx * n_chunk) // (2 * nv * n_scored))
        raise LogitdiffError(
            f"{path}: truncated: {size} bytes, header (n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}) "
            f"needs {want}; only {have_chunks} whole chunks present"
        )
    if size > want:
        raise LogitdiffError(f"{path}: {size - want} unexpected trailing bytes after {n_chunk} chunks")
    return n_ctx, n_vocab, n_chunk


def import_llamacpp_kld(
    path: str | Path,
    out: str | Path,
    *,
    bos_id: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """A llama-perplexity ``--kl-divergence-base`` file as a RUN at ``out`` (locked for the
    whole call, the checks of every row included; re-entered when the caller holds it)."""
    with reserved(out, Kind.RUN, inputs=[path], overwrite=overwrite):
        return _import_llamacpp_kld(Path(path), out, bos_id=bos_id, overwrite=overwrite, progress=progress)


def _import_llamacpp_kld(path: Path, out: str | Path, *, bos_id: int | None, overwrite: bool,
                         progress: Callable[[int], None] | None) -> Path:
    path = Path(path)
    if not path.exists():
        raise LogitdiffError(f"{path}: file not found")
    n_ctx, n_vocab, n_chunk = read_kld_header(path)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_scored = n_ctx - 1 - first
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tokens = np.frombuffer(mm, dtype="<i4", count=n_ctx * n_chunk, offset=20).reshape(n_chunk, n_ctx)
    for c in range(n_chunk):  # the one check of ids (validate.py), naming chunk and position
        validate.token_ids(tokens[c], n_vocab, f"{path}: token block chunk {c}")
    data_off = 20 + 4 * n_ctx * n_chunk
    rows = np.frombuffer(mm, dtype="<u2", count=nv * n_scored * n_chunk, offset=data_off).reshape(n_chunk, n_scored, nv)
    # Every row's scale and minimum first (8 bytes a row): a corrupt row is a one-line
    # error before any output exists, not a failure half-way through the import.
    for c in range(n_chunk):
        scale_min = np.ascontiguousarray(rows[c, :, :4]).view("<f4")  # [n_scored, 2]
        with np.errstate(over="ignore", invalid="ignore"):
            top = scale_min[:, 0] * np.float32(65535) + scale_min[:, 1]
        bad = ~(np.isfinite(scale_min).all(1) & np.isfinite(top))
        if bad.any():
            r = int(np.nonzero(bad)[0][0])
            values = np.array([scale_min[r, 0], scale_min[r, 1], top[r]])
            raise LogitdiffError(nonfinite_message(
                f"{path}: chunk {c} scored row {r} (scale {float(scale_min[r, 0])!r}, min_log_prob {float(scale_min[r, 1])!r})",
                values))
    with writing(out, Kind.RUN, inputs=[path], overwrite=overwrite) as tmp:
        w = RunWriter(
            tmp,
            source={"spec": f"llamacpp-kld:{path}", "kind": "llamacpp-kld", "file": str(path), "identity": {"backend": "llama.cpp llama-perplexity", "n_ctx": n_ctx}},
            vocab_size=n_vocab,
            tokenizer_hash=None,
            store="full",
            dtype="float32",
            settings={"imported_from": "llamacpp-kld", "n_ctx": n_ctx, "n_chunk": n_chunk, "first_scored": first, "bos_id": bos_id},
            chunk_rows=max(1, (64 << 20) // (4 * n_vocab)),
        )
        try:
            for c in range(n_chunk):
                r = rows[c]
                scale_min = np.ascontiguousarray(r[:, :4]).view("<f4")  # [n_scored, 2]
                q = r[:, 4 : 4 + n_vocab].astype(np.float32)
                logp = scale_min[:, 0:1] * q + scale_min[:, 1:2]
                prompt = tokens[c, : first + 1].tolist()
                if bos_id is not None:
                    prompt[0] = int(bos_id)
                teacher = tokens[c, first + 1 :].tolist()
                item = RunItem(
                    id=f"chunk-{c:05d}",
                    prompt_ids=prompt,
                    teacher_ids=teacher,
                    positions=list(range(n_scored)),
                    tags=["llamacpp-chunk"],
                )
                w.add(item, logits=logp)
                if progress:
                    progress(1)
            w.finish()
        except BaseException:
            _close_quietly(w)
            raise
    return Path(out)


def _close_quietly(writer: RunWriter) -> None:
    try:
        writer.close()
    except Exception:
        pass


def write_llamacpp_kld(path: str | Path, logits: np.ndarray, tokens: np.ndarray) -> None:
    """Write a ``--kl-divergence-base`` file from logits ``[n_chunk, n_ctx, V]`` and
    tokens ``[n_chunk, n_ctx]`` in llama.cpp's exact layout and arithmetic (float32
    math, the max-16 floor, round-to-nearest via the 1.5*2^23 trick). Used by tests to
    produce the real format without a llama.cpp binary."""
    logits = np.asarray(logits, dtype=np.float32)
    tokens = np.asarray(tokens, dtype="<i4")
    n_chunk, n_ctx, n_vocab = logits.shape
    first = n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        f.write(tokens.tobytes())
        for c in range(n_chunk):
            for i in range(first, n_ctx - 1):
                z = logits[c, i]
                mx = np.float32(z.max())
                mn = np.float32(max(z.min(), mx - np.float32(16)))
                sum_exp = float(np.exp((z - mx).astype(np.float32)).astype(np.float64).sum())
                lse = np.float32(np.log(sum_exp))
                min_log_prob = np.float32(mn - mx - lse)
                scale = np.float32((mx - mn) / np.float32(65535.0))
                row = np.zeros(nv, dtype="<u2")
                row[:4] = np.frombuffer(np.array([scale, min_log_prob], dtype="<f4").tobytes(), dtype="<u2")
                if scale:
                    inv = np.float32(1) / scale
                    v = (inv * (z - mn)).astype(np.float32)
                    qv = np.rint(v).astype(np.int64)  # nearest_int: round half to even
                    row[4 : 4 + n_vocab] = np.where(z > mn, qv, 0).astype("<u2")
                f.write(row.tobytes())


# Longest output position an import accepts: the teacher sequence up to it is kept as a
# list of ids, so a corrupt 1e10 must be refused rather than allocated (74 GiB).
MAX_POSITION = 1 << 22
_NPZ_FLOATS = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def nonfinite_message(where: str, row: np.ndarray) -> str:
    """Why a row of logits is refused: NaN, +inf, or -inf (masked tokens)."""
    if np.isnan(row).any():
        return f"{where}: logits hold NaN"
    if np.isposinf(row).any():
        return f"{where}: logits hold +inf (overflow in the export?)"
    return (f"{where}: logits hold -inf: masked tokens are not supported (every token needs a finite logit); "
            "export the unmasked logits, or replace -inf by a finite value far below the row's maximum (e.g. max - 1e4)")


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _npz_array(z, path: Path, key: str) -> np.ndarray:
    try:
        return z[key]
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise LogitdiffError(f"{path}: field {key!r} is an object array (pickled); save it as strings or integers") from None
        raise LogitdiffError(f"{path}: field {key!r} unreadable ({_one_line(e)})") from None
    except Exception as e:  # zipfile.BadZipFile, zlib.error, EOFError, OSError: a damaged archive
        raise LogitdiffError(
            f"{path}: field {key!r} unreadable, the .npz is damaged or truncated ({type(e).__name__}: {_one_line(e)})"
        ) from None


def _first_outside(arr: np.ndarray, low: int, high: int) -> int | None:
    """Row of the first value outside [low, high), or None (no int64 overflow for uint64)."""
    bad = (arr < low) | (arr >= high)
    return int(np.nonzero(bad)[0][0]) if bad.any() else None


# What an imported .npz's members may inflate to, per byte of the file: a model's logits do
# not deflate below ~1/3 of their size (their low mantissa bits are noise; bf16 values held
# as float32 ~1/2), and ids and positions are small beside them; a zip bomb's members claim
# ~1000x. IMPORT_SLACK lets a small file hold small, very regular arrays (ids, positions).
IMPORT_MAX_RATIO = 100
IMPORT_SLACK = 64 << 20


def _check_teacher_span(path: Path, ids: list[str], pos: np.ndarray, logits: np.ndarray) -> None:
    """Each item's teacher sequence runs to its largest position (ids unknown: -1), kept as a
    list in memory and in the RUN's items.jsonl (~4 bytes an entry): sparse positions would
    make a few KiB of input into GiB (issue 39). Together they may hold one entry per logit
    imported, or one teacher sequence of MAX_POSITION: the RUN is then a small multiple of
    the input's logits, never more."""
    last: dict[str, int] = {}
    for i, p in zip(ids, pos.tolist()):
        last[i] = max(last.get(i, -1), p)
    total = sum(p + 1 for p in last.values())
    allowed = max(int(logits.shape[0]) * int(logits.shape[1]), MAX_POSITION)
    if total > allowed:
        worst = max(last, key=lambda i: last[i])
        raise LogitdiffError(f"{path}: field 'positions' spans {total} teacher positions over {len(last)} items (item "
                             f"{worst!r} up to {last[worst]}), more than the {allowed} its {logits.shape[0]} rows of "
                             f"{logits.shape[1]} logits may stand for; positions must be the items' output positions, "
                             "not sparse indices")


def import_npz(path: str | Path, out: str | Path, *, overwrite: bool = False, vocab_size: int | None = None) -> Path:
    """Import ``logits [N, V]``, ``token_ids [N]``, ``item_ids [N]``, ``positions [N]``.

    Everything is checked before the output is touched: dtypes (float logits, integer
    ids and positions, string or integer item ids), shapes, ranges, finiteness. ``out`` is
    locked for the whole call, those checks included (re-entered when the caller holds it)."""
    with reserved(out, Kind.RUN, inputs=[path], overwrite=overwrite):
        return _import_npz(Path(path), out, overwrite=overwrite, vocab_size=vocab_size)


def _import_npz(path: Path, out: str | Path, *, overwrite: bool, vocab_size: int | None) -> Path:
    path = Path(path)
    if not path.exists():
        raise LogitdiffError(f"{path}: file not found")
    # the import holds every array in memory: a file, or members inflating to, more than the
    # machine's memory cannot be imported, and is refused before anything is inflated
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open_input(path, max_bytes=memory) as f:
        bound = min(memory, IMPORT_MAX_RATIO * os.fstat(f.fileno()).st_size + IMPORT_SLACK)
        return _import_npz_file(path, f, bound, out, overwrite=overwrite, vocab_size=vocab_size)


def _import_npz_file(path: Path, f, memory: int, out: str | Path, *, overwrite: bool, vocab_size: int | None) -> Path:
    try:
        if zipfile.is_zipfile(f):
            npzinflate.check_claims(f, memory)
            npzinflate.check_headers(f)
        f.seek(0)
        z = np.load(f, allow_pickle=False)
    except Exception as e:  # ValueError, OSError, zipfile.BadZipFile, EOFError
        raise LogitdiffError(f"{path}: not a readable .npz ({type(e).__name__}: {_one_line(e)})") from None
    if not hasattr(z, "files"):
        raise LogitdiffError(f"{path}: a single .npy array, not a .npz with logits, token_ids, item_ids, positions")
    for key in ("logits", "token_ids", "item_ids", "positions"):
        if key not in z.files:
            raise LogitdiffError(f"{path}: missing array {key!r} (needs logits, token_ids, item_ids, positions)")
    logits = _npz_array(z, path, "logits")
    tok_raw = _npz_array(z, path, "token_ids")
    ids_raw = _npz_array(z, path, "item_ids")
    pos_raw = _npz_array(z, path, "positions")
    if logits.dtype not in _NPZ_FLOATS:
        raise LogitdiffError(f"{path}: field 'logits' has dtype {logits.dtype}; expected float16, float32 or float64")
    for key, arr in (("token_ids", tok_raw), ("positions", pos_raw)):
        if arr.dtype.kind not in "iu":
            raise LogitdiffError(f"{path}: field {key!r} has dtype {arr.dtype}; expected integers")
    if ids_raw.dtype.kind not in "iuUS":
        raise LogitdiffError(f"{path}: field 'item_ids' has dtype {ids_raw.dtype}; expected strings or integers")
    n = logits.shape[0] if logits.ndim else 0
    if logits.ndim != 2 or not (tok_raw.shape == pos_raw.shape == ids_raw.shape == (n,)):
        raise LogitdiffError(
            f"{path}: shapes logits {logits.shape}, token_ids {tok_raw.shape}, item_ids {ids_raw.shape}, "
            f"positions {pos_raw.shape} do not agree"
        )
    if n == 0 or logits.shape[1] == 0:
        raise LogitdiffError(f"{path}: no rows or an empty vocabulary (logits {logits.shape})")
    ids = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in ids_raw.tolist()]
    V = logits.shape[1]
    if vocab_size is not None and V != vocab_size:
        raise LogitdiffError(f"{path}: logits have V={V}, expected {vocab_size}")
    try:
        validate.token_ids(tok_raw, V, f"{path}: field 'token_ids'", what="row")
    except LogitdiffError as e:
        r = _first_outside(tok_raw, 0, V)
        raise LogitdiffError(f"{e}" + (f" (item {ids[r]!r})" if r is not None else "")) from None
    r = _first_outside(pos_raw, 0, MAX_POSITION)
    if r is not None:
        raise LogitdiffError(
            f"{path}: field 'positions' has {pos_raw[r]} (row {r}, item {ids[r]!r}) outside [0, {MAX_POSITION})"
        )
    tok = tok_raw.astype(np.int64)
    pos = pos_raw.astype(np.int64)
    _check_teacher_span(path, ids, pos, logits)
    dtype = _NPZ_FLOATS[logits.dtype]
    order: list[str] = []
    rows_of: dict[str, list[int]] = {}
    for r, i in enumerate(ids):
        if i not in rows_of:
            rows_of[i] = []
            order.append(i)
        rows_of[i].append(r)
    plan = []
    for iid in order:
        rr = np.asarray(rows_of[iid])
        rr = rr[np.argsort(pos[rr], kind="stable")]
        p = pos[rr]
        if len(np.unique(p)) != len(p):
            dup = int(p[np.nonzero(np.diff(p) == 0)[0][0]])
            raise LogitdiffError(f"{path}: item {iid!r} has position {dup} twice")
        # max and min propagate NaN and expose ±inf without a full boolean temporary.
        block = logits[rr]
        if not (np.isfinite(block.max()) and np.isfinite(block.min())):
            bad = int(np.nonzero(~np.isfinite(block).all(1))[0][0])
            raise LogitdiffError(nonfinite_message(f"{path}: item {iid!r} position {int(p[bad])}", block[bad]))
        plan.append((iid, rr, p))
    with writing(out, Kind.RUN, inputs=[path], overwrite=overwrite) as tmp:
        w = RunWriter(
            tmp,
            source={"spec": f"npz:{path}", "kind": "npz", "file": str(path)},
            vocab_size=V,
            tokenizer_hash=None,
            store="full",
            dtype=dtype,
            settings={"imported_from": "npz"},
            chunk_rows=max(1, (64 << 20) // (4 * V)),
        )
        try:
            for iid, rr, p in plan:
                teacher = np.full(int(p.max()) + 1, -1, dtype=np.int64)
                teacher[p] = tok[rr]
                w.add(RunItem(id=iid, prompt_ids=[], teacher_ids=teacher.tolist(), positions=p.tolist()),
                      logits=np.asarray(logits[rr]))
            w.finish()
        except BaseException:
            _close_quietly(w)
            raise
    return Path(out)
