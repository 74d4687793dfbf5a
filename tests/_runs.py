"""Shared checks of RUN writing tests (test_store, test_store_sync)."""

import numpy as np

from logitdiff.store import RunReader, RunWriter


def finish_resumed(writer: RunWriter, data) -> None:
    """Add the items of ``data`` (``(RunItem, logits)`` pairs) that a resumed ``writer`` does
    not hold yet, finish, and check the RUN reads back as ``data``: ids in order, logits bit
    for bit."""
    done = writer.done_ids()
    for it, lg in data:
        if it.id not in done:
            writer.add(it, logits=lg)
    writer.finish()
    r = RunReader(writer.path)
    assert [g.id for g in r.items()] == [it.id for it, _ in data]
    for g, (_, lg) in zip(r.items(), data):
        np.testing.assert_array_equal(r.logits(g), lg)
