"""The texts of a labelled set with its labels taken out, for a second blind reader.

    python tests/data/flip_labels_blind_texts.py tests/data/flip_labels_smollm_b.jsonl \
        tests/data/flip_labels_smollm_b_workload.jsonl > /tmp/texts.jsonl

Per branch: the id, the item (id, tags, prompt as its chat messages, answer label, tool
names), the output before the flip, the reference's and the branch's continuation and whether
each hit the token budget: what `flip_labels_dump.py` gives the first reader. Nothing else of
the labelled row (label, sure, note) and nothing the classifier computed is written. The second
reader labelled from this file and the rules of docs/flips.md ("Labelling real branches")
alone: tests/data/flip_labels_*_reader2.jsonl.
"""

from __future__ import annotations

import json
import sys


def main(labelled: str, workload: str) -> None:
    items = {}
    for line in open(workload, encoding="utf-8"):
        if line.strip():
            it = json.loads(line)
            items[it["id"]] = it
    for line in open(labelled, encoding="utf-8"):
        if not line.strip():
            continue
        r = json.loads(line)
        it = items.get(r["item"]["id"], {})
        prompt = it.get("prompt") or "\n".join(f'{m["role"]}: {m["content"]}' for m in it.get("messages", []))
        tools = [t.get("name") if isinstance(t, dict) else t for t in it.get("tools", [])] or None
        print(json.dumps({"id": r["id"], "item_id": r["item"]["id"], "tags": r["item"].get("tags", []), "prompt": prompt,
                          "answer_label": it.get("label"), "tools": tools, "output_before_flip": r["prefix"],
                          "reference_continuation": r["ref"], "branch_continuation": r["branch"],
                          "reference_hit_budget": r["ref_cut"], "branch_hit_budget": r["branch_cut"]}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
