"""One validation of token ids and log-probabilities, wherever they come in.

Entry points (each calls these and nothing else to judge ids and log-probabilities):
servers' answers (:mod:`.sources.served`), stored chunks and items read back
(:class:`.store.RunReader`), a reference's teacher tokens (:mod:`.capture`) and imports
(:mod:`.importers`). Pure functions over values and arrays; a violation is a one-line
:class:`LogitdiffError` naming ``where`` (the source or file, the item) and the position.

The rules:

* a token id is an integer (not a bool, not a float, not a string unless ``keys``: vLLM
  sends ids as JSON object keys) in ``[0, V)``;
* one top-K row holds each id once;
* a log-probability is a number (not a bool), finite where the store holds it (servers may
  send ``-inf``/``null`` for an impossible token: those entries are dropped, and fewer than
  K finite ones is refused by the caller), and at most :data:`LOGPROB_TOL`;
* arrays have the dtype their store declares (ids integers, log-probabilities floats,
  full rows exactly the declared dtype).

Why a tolerance above 0: a log-softmax computed in float32 rounds the log-probability of a
near-certain token (p within a few ulps of 1) to a tiny positive number (one float32 ulp at
1.0 is 1.2e-7; servers' float32 kernels give up to a few of them). Values in
``(0, LOGPROB_TOL]`` are accepted as they are, not clamped: their effect on any KL is below
1e-6 nats, under every floor a report reads. Anything above is not a log-probability.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ..errors import LogitdiffError

LOGPROB_TOL = 1e-6


def _show(x: Any, limit: int = 40) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def token_id(x: Any, vocab_size: int | None, where: str, *, keys: bool = False) -> int:
    """One id from parsed JSON: an int (a decimal string only when ``keys``) in [0, V)."""
    v = x
    if keys and isinstance(x, str):
        s = x.strip()
        if not (s.isascii() and s.removeprefix("-").isdigit() and len(s) <= 400):
            raise LogitdiffError(f"{where}: token id {_show(x)} is not an integer")
        v = int(s)
    elif isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise LogitdiffError(f"{where}: token id {_show(x)} is not an integer")
    v = int(v)
    if v < 0 or (vocab_size is not None and v >= vocab_size):
        bound = vocab_size if vocab_size is not None else "V"
        raise LogitdiffError(f"{where}: token id {_show(v)} outside [0, {bound})")
    return v


def logprob(x: Any, where: str) -> float | None:
    """One log-probability from parsed JSON: None stays None (no value), else a real
    number <= LOGPROB_TOL (``-inf`` allowed: an impossible token)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise LogitdiffError(f"{where}: log-probability {_show(x)} is not a number")
    try:
        v = float(x)
    except OverflowError:  # an int beyond float range
        raise LogitdiffError(f"{where}: log-probability {_show(x)} is not a log-probability") from None
    if math.isnan(v) or v == math.inf:
        raise LogitdiffError(f"{where}: log-probability {v} is not a log-probability")
    if v > LOGPROB_TOL:
        raise LogitdiffError(f"{where}: log-probability {v:.6g} > 0: not a log-probability")
    return v


def check_ids(ids: list, vocab_size: int, where: str, *, what: str = "token", allow: int | None = None) -> None:
    """:func:`token_ids` without building the array: a list of plain ints (what JSON gives)
    is judged by its min and max in C (items of a big RUN hold millions of ids)."""
    if isinstance(ids, list) and set(map(type, ids)) <= {int}:  # C speed; bools are not ints here
        if not ids:
            return
        lo, hi = min(ids), max(ids)
        # lo == allow == -1: the smallest is -1, so every negative one is -1
        if hi < vocab_size and (lo >= 0 or lo == allow == -1):
            return
    token_ids(ids, vocab_size, where, what=what, allow=allow)


def token_ids(ids: Any, vocab_size: int, where: str, *, what: str = "token", allow: int | None = None) -> np.ndarray:
    """A sequence of ids (list from JSON, or an integer array) as int64, each in [0, V)
    (``allow``: one more value accepted, e.g. -1 for "unknown" in an imported RUN).
    The error names the position in the sequence."""
    arr: np.ndarray | None
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise LogitdiffError(f"{where}: {what} ids have dtype {ids.dtype}, expected integers")
        arr = ids.reshape(-1)
    else:
        seq = ids if isinstance(ids, list) else list(ids)
        arr = None
        if all(type(x) is int for x in seq):  # the common case (JSON lists): one C-speed pass
            try:
                arr = np.asarray(seq, dtype=np.int64) if seq else np.zeros(0, np.int64)
            except OverflowError:
                arr = None
        if arr is None:  # find and name the offender
            for j, x in enumerate(seq):
                if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                    raise LogitdiffError(f"{where}: {what} position {j}: id {_show(x)} is not an integer")
                if not (-(1 << 63) <= int(x) < (1 << 63)):
                    raise LogitdiffError(f"{where}: {what} position {j}: id {_show(x)} outside [0, {vocab_size})")
            arr = np.asarray(seq, dtype=np.int64) if seq else np.zeros(0, np.int64)
    bad = (arr < 0) | (arr >= vocab_size)
    if allow is not None:
        bad &= arr != allow
    if bad.any():
        j = int(np.argmax(bad))
        raise LogitdiffError(f"{where}: {what} position {j}: id {int(arr[j])} outside [0, {vocab_size})")
    return arr.astype(np.int64, copy=False)


def topk_rows(ids: Any, logprobs: Any, vocab_size: int, k: int, where: str, *,
              label: Callable[[int], str] | None = None) -> None:
    """A block of stored or received top-K rows: ``ids [n, K]`` integers in [0, V), unique
    per row; ``logprobs [n, K]`` floats, finite, <= LOGPROB_TOL. ``label(r)`` names row r
    in errors (its item and output position; else "row r")."""
    ids, lps = np.asarray(ids), np.asarray(logprobs)
    if ids.dtype.kind not in "iu":
        raise LogitdiffError(f"{where}: top-K ids have dtype {ids.dtype}, expected integers")
    if lps.dtype.kind != "f":
        raise LogitdiffError(f"{where}: top-K logprobs have dtype {lps.dtype}, expected floats")
    if ids.ndim != 2 or lps.shape != ids.shape or ids.shape[1] != k:
        raise LogitdiffError(f"{where}: top-K ids shape {ids.shape} and logprobs shape {lps.shape}, expected (n, {k})")
    if not ids.size:
        return

    def at(r: int) -> str:
        r = int(r)
        try:
            return f"{where}: {label(r)}" if label is not None else f"{where}: row {r}"
        except Exception:  # noqa: BLE001 - a damaged run may not say which item: the row then
            return f"{where}: row {r}"

    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise LogitdiffError(f"{at(r)}: token id {int(ids[r, c])} outside [0, {vocab_size})")
    if k > 1:
        s = np.sort(ids, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(1)
        if dup.any():
            r = int(np.argmax(dup))
            row = np.sort(ids[r])
            t = int(row[1:][row[1:] == row[:-1]][0])
            raise LogitdiffError(f"{at(r)}: token id {t} twice in one top-K row")
    if not (np.isfinite(lps.max()) and np.isfinite(lps.min())):
        r = int(np.nonzero(~np.isfinite(lps).all(1))[0][0])
        raise LogitdiffError(f"{at(r)}: log-probability {lps[r][~np.isfinite(lps[r])][0]} is not finite")
    if lps.max() > LOGPROB_TOL:
        r = int(np.nonzero((lps > LOGPROB_TOL).any(1))[0][0])
        raise LogitdiffError(f"{at(r)}: log-probability {float(lps[r].max()):.6g} > 0: not a log-probability")


def rows_dtype(arr: np.ndarray, declared: np.dtype, where: str, *, name: str | None = None) -> None:
    """Full-logit rows must have exactly the declared storage dtype (bf16 as uint16 bits;
    ``name``: how the RUN declares it)."""
    if np.dtype(arr.dtype) != np.dtype(declared):
        want = name or str(np.dtype(declared))
        stored = f" (stored as {np.dtype(declared)})" if name and name != str(np.dtype(declared)) else ""
        raise LogitdiffError(f"{where}: rows have dtype {arr.dtype}, the RUN declares {want}{stored}")
