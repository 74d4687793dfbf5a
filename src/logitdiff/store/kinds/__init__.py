"""Store kinds (``--store TEXT``) as objects: one class per kind (base.StoreKind), found
through ``STORE_KINDS`` by the first word of the text. ``RunWriter``/``RunReader`` and
``merge`` call the kind; the comparison methods are chosen from what two runs' kinds give
a reader (``StoreKind.reads_as``). A new kind is one class and one line below (a test
registers one from its own file: tests/test_store_kinds.py)."""

from __future__ import annotations

from typing import Any

from ...errors import LogitdiffError
from .base import Block, BlockPlace, RowsForm, StoreKind, check_full_rows, cut_rows
from .compact import CompactStore
from .full import FullStore
from .hidden import HiddenStore
from .topk import TopKStore

# the first word of --store -> its kind (one line per kind)
STORE_KINDS: dict[str, type[StoreKind]] = {
    FullStore.name: FullStore,
    TopKStore.name: TopKStore,
    CompactStore.name: CompactStore,
    HiddenStore.name: HiddenStore,
}

# ``run --reference-store``'s word for "the best lossless kind the reference allows" (auto_kind)
AUTO = "auto"

__all__ = ["AUTO", "STORE_KINDS", "Block", "BlockPlace", "RowsForm", "StoreKind", "auto_kind", "check_full_rows", "cut_rows",
           "given_rows_kind", "reference_store_choices", "store_help", "store_kind", "store_usage"]


def store_usage() -> str:
    """Every registered spelling of --store, for errors and --help."""
    usages = [cls.usage for cls in STORE_KINDS.values()]
    return ", ".join(usages[:-1]) + f" or {usages[-1]}" if len(usages) > 1 else usages[0]


def store_help() -> str:
    """--store's help: every registered kind with what it keeps."""
    return "; ".join(f"{cls.usage} ({cls.summary})" if cls.summary else cls.usage for cls in STORE_KINDS.values())


def store_kind(text: str, vocab_size: int | None = None, dtype: str | None = None) -> StoreKind:
    """The kind of a ``--store`` text, bound to a run's vocabulary size and logits dtype
    (either may be None while only the text is checked); a one-line error otherwise."""
    cls = STORE_KINDS.get(str(text).partition(":")[0])
    if cls is None:
        raise LogitdiffError(f"--store {text!r}: expected {store_usage()}")
    return cls.parse(str(text), vocab_size, dtype)



def reference_store_choices() -> tuple[str, ...]:
    """What ``run --reference-store`` takes: ``auto`` and every lossless kind (a reader gets
    the reference's rows bit for bit, so its reports are the same whichever is chosen)."""
    return (AUTO, *(name for name, cls in STORE_KINDS.items() if cls.lossless))


def auto_kind(source: Any) -> str:
    """What ``auto`` picks for ``source`` (a ``sources.Source``): of the lossless kinds that
    can keep it, the one of the highest ``auto_rank`` (the first registered among equals)."""
    fits = [cls for cls in STORE_KINDS.values() if cls.lossless and cls.can_keep(source)]
    if not fits:
        raise LogitdiffError(f"--reference-store {AUTO}: no registered lossless store kind keeps {getattr(source, 'spec', source)}")
    return max(fits, key=lambda cls: cls.auto_rank).name


def given_rows_kind(top_k: int, vocab_size: int | None = None, dtype: str | None = None) -> StoreKind:
    """The kind that keeps a source's rows as it gives them: full rows (``top_k`` 0) or
    top-K lists of ``top_k`` entries (a served source): the first registered that does."""
    for cls in STORE_KINDS.values():
        kind = cls.as_given(top_k, vocab_size, dtype)
        if kind is not None:
            return kind
    raise LogitdiffError(f"no registered store kind keeps {'top-' + str(top_k) + ' lists' if top_k else 'full rows'} as given")
