"""Dump the branches of a `logitdiff run` for blind labelling: texts only, no verdicts.

    python tests/data/flip_labels_dump.py OUT [--reports NAME ...] > /tmp/cases.jsonl

For every branch in OUT/reports/*/flips.parquet: the candidate, the item (id, tags, prompt,
answer label, tool names), the output before the flip (the teacher ids decoded with the run's
own tokenizer: the token strings OUT/runs/reference/tokens.json records, byte-level BPE or
SentencePiece spelling; a run without them is decoded by opening its source spec), the
reference's continuation and the branch's continuation, and whether each hit the token
budget. Nothing
the classifier computed (outcome, decided_by, similarity, re-join, signals) is written: the
labeller reads these and nothing else (tests/data/flip_labels_real.jsonl records that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHOWN = ("item_id", "position", "ref_continuation", "branch_continuation", "ref_cut", "branch_cut")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE spells byte b as one printable character; this undoes it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_decoder(tokens: list[str | None]):
    """ids -> text from a run's token strings (tokens.json): byte-level BPE (GPT-2 / Llama 3 /
    SmolLM: 'Ġ' a space, 'Ċ' a newline) when such tokens are common, else SentencePiece
    ('\u2581' a space, '<0xNN>' a byte). Added tokens (chat markers) come out as written."""
    strs = [t or "" for t in tokens]
    byte_level = sum(t.startswith("Ġ") for t in strs) > 0.01 * max(1, len(strs))
    if byte_level:
        table = _gpt2_byte_decoder()

        def piece(t: str) -> bytes:
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in t)
    else:
        import re

        byte_re = re.compile(r"^<0[xX]([0-9a-fA-F]{2})>$")

        def piece(t: str) -> bytes:
            m = byte_re.match(t)
            return bytes([int(m.group(1), 16)]) if m else t.replace("\u2581", " ").encode()

    def decode(ids) -> str:
        return b"".join(piece(strs[int(i)]) for i in ids).decode("utf-8", errors="replace")

    return decode


def run_decoder(ref):
    """The decoder of the run's own tokenizer: its recorded token strings, else its source."""
    tokens = ref.tokens()
    if tokens is not None:
        return token_decoder(tokens)
    from logitdiff.sources import open_source

    src = open_source(ref.manifest["source"]["spec"])
    return lambda ids: src.detokenize([int(i) for i in ids])


def dump(out: Path, names: list[str] | None = None):
    import pyarrow.parquet as pq

    from logitdiff.store import RunReader

    ref = RunReader(out / "runs" / "reference")
    decode = run_decoder(ref)
    items = {it.id: it for it in ref.items()}
    for rdir in sorted((out / "reports").iterdir()):
        if names and rdir.name not in names or not (rdir / "flips.parquet").exists():
            continue
        table = pq.read_table(rdir / "flips.parquet", columns=[c for c in SHOWN if c in pq.read_schema(rdir / "flips.parquet").names])
        for r in table.to_pylist():
            it = items[r["item_id"]]
            item = dict(it.extra.get("item") or {})
            prefix = decode(it.teacher_ids[: r["position"]])
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
