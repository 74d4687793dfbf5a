"""Dump the branches of a `logitdiff run` for blind labelling: texts only, no verdicts.

    python tests/data/flip_labels_dump.py OUT [--reports NAME ...] > /tmp/cases.jsonl

For every branch in OUT/reports/*/flips.parquet: the candidate, the item (id, tags, prompt,
answer label, tool names), the output before the flip (decoded teacher ids), the reference's
continuation and the branch's continuation, and whether each hit the token budget. Nothing
the classifier computed (outcome, decided_by, similarity, re-join, signals) is written: the
labeller reads these and nothing else (tests/data/flip_labels_real.jsonl records that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHOWN = ("item_id", "position", "ref_continuation", "branch_continuation", "ref_cut", "branch_cut")


def dump(out: Path, names: list[str] | None = None):
    import pyarrow.parquet as pq

    from logitdiff.builtin import TINY_DIR
    from logitdiff.store import RunReader
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    ref = RunReader(out / "runs" / "reference")
    items = {it.id: it for it in ref.items()}
    for rdir in sorted((out / "reports").iterdir()):
        if names and rdir.name not in names or not (rdir / "flips.parquet").exists():
            continue
        table = pq.read_table(rdir / "flips.parquet", columns=[c for c in SHOWN if c in pq.read_schema(rdir / "flips.parquet").names])
        for r in table.to_pylist():
            it = items[r["item_id"]]
            item = dict(it.extra.get("item") or {})
            prefix = tok.decode(list(it.teacher_ids[: r["position"]]), skip_special_tokens=False)
            yield {
                "id": f"{rdir.name}/{r['item_id']}@{r['position']}",
                "candidate": rdir.name,
                "item": {"id": it.id, "tags": list(it.tags), "expected": item.get("expected"),
                         "tools": [t["function"]["name"] if "function" in t else t.get("name") for t in item.get("tools") or []],
                         "prompt": it.prompt if isinstance(it.prompt, str) else json.dumps(it.prompt)},
                "prefix": prefix,
                "ref": r["ref_continuation"],
                "branch": r["branch_continuation"],
                "ref_cut": r.get("ref_cut"),
                "branch_cut": r.get("branch_cut"),
            }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--reports", nargs="*")
    a = ap.parse_args()
    for case in dump(a.out, a.reports):
        sys.stdout.write(json.dumps(case, ensure_ascii=False) + "\n")
