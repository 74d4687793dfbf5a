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

import struct
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import LogitdiffError
from .store import RunItem, RunWriter

MAGIC = b"_logits_"


def read_kld_header(path: Path) -> tuple[int, int, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
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
    path = Path(path)
    if not path.exists():
        raise LogitdiffError(f"{path}: file not found")
    n_ctx, n_vocab, n_chunk = read_kld_header(path)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_scored = n_ctx - 1 - first
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tokens = np.frombuffer(mm, dtype="<i4", count=n_ctx * n_chunk, offset=20).reshape(n_chunk, n_ctx)
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise LogitdiffError(f"{path}: token ids outside [0, {n_vocab}) in the token block")
    data_off = 20 + 4 * n_ctx * n_chunk
    rows = np.frombuffer(mm, dtype="<u2", count=nv * n_scored * n_chunk, offset=data_off).reshape(n_chunk, n_scored, nv)
    w = RunWriter(
        out,
        source={"spec": f"llamacpp-kld:{path}", "kind": "llamacpp-kld", "file": str(path), "identity": {"backend": "llama.cpp llama-perplexity", "n_ctx": n_ctx}},
        vocab_size=n_vocab,
        tokenizer_hash=None,
        store="full",
        dtype="float32",
        settings={"imported_from": "llamacpp-kld", "n_ctx": n_ctx, "n_chunk": n_chunk, "first_scored": first, "bos_id": bos_id},
        chunk_rows=max(1, (64 << 20) // (4 * n_vocab)),
        overwrite=overwrite,
    )
    for c in range(n_chunk):
        r = rows[c]
        scale_min = np.ascontiguousarray(r[:, :4]).view("<f4")  # [n_scored, 2]
        q = r[:, 4 : 4 + n_vocab].astype(np.float32)
        logp = scale_min[:, 0:1] * q + scale_min[:, 1:2]
        if not np.isfinite(logp).all():
            bad = int(np.nonzero(~np.isfinite(logp).all(1))[0][0])
            raise LogitdiffError(f"{path}: chunk {c} scored row {bad} holds NaN/inf (corrupt file)")
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
    return Path(out)


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


def import_npz(path: str | Path, out: str | Path, *, overwrite: bool = False, vocab_size: int | None = None) -> Path:
    path = Path(path)
    if not path.exists():
        raise LogitdiffError(f"{path}: file not found")
    try:
        z = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise LogitdiffError(f"{path}: not a readable .npz ({e})") from None
    for key in ("logits", "token_ids", "item_ids", "positions"):
        if key not in z.files:
            raise LogitdiffError(f"{path}: missing array {key!r} (needs logits, token_ids, item_ids, positions)")
    logits = z["logits"]
    tok = z["token_ids"].astype(np.int64)
    ids = [str(x) for x in z["item_ids"]]
    pos = z["positions"].astype(np.int64)
    n = logits.shape[0]
    if logits.ndim != 2 or not (tok.shape == pos.shape == (n,)) or len(ids) != n:
        raise LogitdiffError(f"{path}: shapes logits {logits.shape}, token_ids {tok.shape}, item_ids ({len(ids)},), positions {pos.shape} do not agree")
    V = logits.shape[1]
    if vocab_size is not None and V != vocab_size:
        raise LogitdiffError(f"{path}: logits have V={V}, expected {vocab_size}")
    if (tok < 0).any() or (tok >= V).any():
        raise LogitdiffError(f"{path}: field 'token_ids' has ids outside [0, {V})")
    if (pos < 0).any():
        raise LogitdiffError(f"{path}: field 'positions' has negative values")
    dtype = {np.dtype(np.float16): "float16", np.dtype(np.float64): "float64"}.get(logits.dtype, "float32")
    w = RunWriter(
        out,
        source={"spec": f"npz:{path}", "kind": "npz", "file": str(path)},
        vocab_size=V,
        tokenizer_hash=None,
        store="full",
        dtype=dtype,
        settings={"imported_from": "npz"},
        chunk_rows=max(1, (64 << 20) // (4 * V)),
        overwrite=overwrite,
    )
    order: list[str] = []
    rows_of: dict[str, list[int]] = {}
    for r, i in enumerate(ids):
        if i not in rows_of:
            rows_of[i] = []
            order.append(i)
        rows_of[i].append(r)
    for iid in order:
        rr = np.asarray(rows_of[iid])
        rr = rr[np.argsort(pos[rr], kind="stable")]
        p = pos[rr]
        if len(np.unique(p)) != len(p):
            dup = int(p[np.nonzero(np.diff(p) == 0)[0][0]])
            raise LogitdiffError(f"{path}: item {iid!r} has position {dup} twice")
        teacher = np.full(int(p.max()) + 1, -1, dtype=np.int64)
        teacher[p] = tok[rr]
        row_logits = np.asarray(logits[rr])
        if not np.isfinite(row_logits).all():
            bad = int(np.nonzero(~np.isfinite(row_logits).all(1))[0][0])
            raise LogitdiffError(f"{path}: item {iid!r} has NaN/inf logits at position {int(p[bad])}")
        w.add(RunItem(id=iid, prompt_ids=[], teacher_ids=teacher.tolist(), positions=p.tolist()), logits=row_logits)
    w.finish()
    return Path(out)
