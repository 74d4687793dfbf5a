"""Stage *report*: what a reader sees — report.json and tokens.parquet (this module), report.md
(`markdown`), report.html (`html`), the verdict lines (`verdict`), gates (`gates`), the
metric registry (`metric_registry`), the layers and speculation pages. Imports `compare`,
`capture`, `sources`, `store`, `numerics` and below.

REPORT directories: report.json (the seed's keys and fields, extended), tokens.parquet,
report.md. Everything is built in memory first and the files are renamed into place, so a
failure never leaves half a report behind."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence, cast

import numpy as np

from .._version import __version__
from ..compare import Comparison
from ..contracts import (SCHEMA_VERSION, GroupStats, NoiseFloor, Report, Side, Summary, json_clean, load_report, migrate_columns,
                         report_json)
from ..numerics.metrics import LN2
from ..contracts import REPORT_SCHEMA
from ..store.files import atomic_path, atomic_write_bytes, write_error
from ..numerics.segments import item_segments, segment_masks, vocab_scheme
from ..numerics.summarize import DEFAULT_RANGES, by_groups, range_masks, summarize_group


# Row fields of the seed report, in its order (its "baseline" is the reference: reference_* since schema 2.0).
SEED_ROW_FIELDS = (
    "reference_top_mass",
    "reference_top_token",
    "reference_top_token_id",
    "candidate_top_mass",
    "candidate_top_token",
    "candidate_top_token_id",
    "kl_bits",
    "kl_nats",
    "shared_reference_mass",
    "shared_candidate_mass",
    "shared_tokens",
    "source_id",
    "top1_match",
)

# A comparison of no positions (every position excluded, items without output): its figures
# are null, with this reason in method.notes, the console, report.md and the page -- never 0.
NO_POSITIONS = "no positions compared: the paired items have no scored positions, so every figure of this report is null"
# What build_report reads of every comparison, given as empty columns when no block was read
# (a method says its columns block by block, and no block means no columns)
_EMPTY_COLUMNS = {
    "top1_ref": np.int64, "top1_cand": np.int64, "top1_match": np.bool_, "kl_nats": np.float64,
    "reference_top_mass": np.float64, "candidate_top_mass": np.float64, "shared_tokens": np.int64,
    "shared_reference_mass": np.float64, "shared_candidate_mass": np.float64,
}


def cpu_class(cpuinfo: str | None = None) -> tuple[str, str]:
    """(key, words) of what moves a run's figures between CPUs: the vendor and the widest SIMD
    level the kernels take (AVX-512 BF16, AVX-512, AVX2), AMX where present. torch's and
    llama.cpp's kernels round differently on each (other logits, ties and noise floor), while
    runs on one machine are deterministic. ``cpuinfo``: the text of /proc/cpuinfo (read when
    None; ("unknown", "instruction set unknown") where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown", "instruction set unknown"
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's fields
        k, _, v = line.partition(":")
        fields.setdefault(k.strip(), v.strip())
    flags = set(fields.get("flags", "").split())
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(fields.get("vendor_id", ""), "other")
    if not flags:
        return f"{vendor}-unknown", "instruction set unknown"
    if "avx512_bf16" in flags:
        level, words = "avx512bf16", "AVX-512 BF16"
    elif "avx512f" in flags:
        level, words = "avx512", "AVX-512, no BF16"
    elif "avx2" in flags:
        level, words = "avx2", "AVX2, no AVX-512"
    else:
        level, words = "noavx2", "no AVX2"
    if "amx_tile" in flags:
        level, words = level + "-amx", words + ", AMX"
    return f"{vendor}-{level}", words


def machine_info() -> dict:
    """Where the comparison ran (the captures' own devices are in each side's identity), with
    the CPU's class (`cpu_class`): figures from machines of other classes differ in their
    last digits and in ties, so a reader comparing published numbers needs it."""
    import os
    import platform

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    key, simd = cpu_class()
    return {"cpu": cpu or platform.processor() or platform.machine(), "cpu_class": key, "simd": simd,
            "cpu_count": os.cpu_count(), "memory_gib": mem, "platform": platform.platform(terse=True),
            "python": platform.python_version()}


def _side(reader, label: str) -> Side:
    m = reader.manifest
    src = m.get("source") or {}
    return {
        "path": str(reader.path),
        "served_model": src.get("served_model") or src.get("spec"),
        "spec": src.get("spec"),
        "identity": src.get("identity"),
        "status": m.get("status"),
        "tokenizer_hash": m.get("tokenizer_hash"),
        "store": m["settings"].get("store"),
        "dtype": m["settings"].get("dtype"),
        "n_items": m.get("n_items"),
        "n_positions": m.get("n_positions"),
        "role": label,
    }


def noise_floor_section(comp: Comparison, *, spec: str | None, rerun: str) -> NoiseFloor:
    """The ``noise_floor`` of report.json and summary.json: the reference (``spec``) compared
    with a rerun of itself; ``rerun`` says which rerun (batch layout, RUN path)."""
    c = comp.columns
    match = np.asarray(c["top1_match"], dtype=bool)
    return {
        "spec": spec,
        "rerun": rerun,
        "kl_nats_mean": float(np.mean(c["kl_nats"])),
        "kl_nats_max": float(np.max(c["kl_nats"])),
        "top1_disagreement": float(1.0 - np.mean(c["top1_match"])),
        "top1_flips": int(np.sum(~match)),
        "positions": int(comp.n),
    }


def build_report(
    comp: Comparison,
    *,
    ranges: Sequence[int] = DEFAULT_RANGES,
    n_boot: int = 1000,
    seed: int = 0,
    include_rows: bool = True,
    noise_floor: NoiseFloor | None = None,
) -> tuple[Report, dict[str, np.ndarray]]:
    """The report.json object and the per-position table (columns) behind it, in steps: the
    columns (the seed's names, bits twins), the summary, the groups (ranges, tags, segments,
    items), the rows, then the table's token texts."""
    c, notes = _report_columns(comp)
    item_tags = {it.id: it.tags for it in comp.items}
    _, item_index = np.unique(c["item_id"].astype(str), return_inverse=True)
    summary = _summary(comp, c, item_index, n_boot=n_boot, seed=seed, noise_floor=noise_floor)
    tag_of_row = [item_tags.get(str(i), []) for i in c["item_id"]]
    range_rows, tag_rows, seg_rows = _group_rows(comp, c, item_index, item_tags, tag_of_row, ranges=ranges, n_boot=n_boot, seed=seed)
    item_rows = _item_rows(comp, c, item_index)
    report: Report = {
        "schema": REPORT_SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "logitdiff", "version": __version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "reference": _side(comp.ref, "reference"),
        "candidate": _side(comp.cand, "candidate"),
        "method": {  # type: ignore[typeddict-item]  # comp.method (compare.methods) holds the rest of Method's keys
            **comp.method,
            "bootstrap": {"resample": "items", "n": n_boot, "seed": seed, "level": 0.95},
            "ranges": list(ranges),
            "notes": notes,
        },
        "rows": [],
        "summary": summary,
        "ranges": range_rows,
        "tags": tag_rows,
        "segments": seg_rows,
        "items": item_rows,
    }
    # _rows builds JSON values already: they join the report after its clean
    rows = _rows(comp, c) if include_rows else None
    if not include_rows:
        report["rows_omitted"] = True
    _add_token_texts(comp, c, tag_of_row)
    report = json_clean(report)
    if rows is not None:
        report["rows"] = rows
    return report, c


def _report_columns(comp: Comparison) -> tuple[dict[str, Any], list[str]]:
    """The comparison's columns with the seed's names and a bits twin of every ``*_nats``
    column (empty ones where no position was compared), and the method's notes."""
    c = dict(comp.columns)
    notes = list(comp.notes)
    if comp.n == 0:
        for key, dtype in _EMPTY_COLUMNS.items():
            c.setdefault(key, np.empty(0, dtype))
        notes.append(NO_POSITIONS)
    # Seed-compatible names and bits twins.
    c["source_id"] = c["item_id"]
    c["reference_top_token_id"] = c["top1_ref"]
    c["candidate_top_token_id"] = c["top1_cand"]
    for key in [k for k in list(c) if k.endswith("_nats")]:
        c[key[:-5] + "_bits"] = np.asarray(c[key], dtype=np.float64) / LN2
    return c, notes


def _summary(comp: Comparison, c: dict[str, Any], item_index: np.ndarray, *, n_boot: int, seed: int,
             noise_floor: NoiseFloor | None) -> Summary:
    """report.json's ``summary``: the seed's fields, the overall group, the proven intervals of
    bounded methods and the floors."""
    n = comp.n
    overall = summarize_group(c, item_index, n_boot=n_boot, seed=seed)
    kl = np.asarray(c["kl_nats"])
    imax = int(np.argmax(kl)) if n else 0
    match = np.asarray(c["top1_match"], dtype=bool)
    summary: Summary = {
        # The seed's summary fields first (its "baseline" is the reference).
        "reference_top_mass_mean": json_clean(np.mean(c["reference_top_mass"])) if n else None,
        "candidate_top_mass_mean": json_clean(np.mean(c["candidate_top_mass"])) if n else None,
        "kl_bits_max": json_clean(kl.max() / LN2) if n else None,
        "kl_bits_mean": json_clean(kl.mean() / LN2) if n else None,
        "kl_nats_max": json_clean(kl.max()) if n else None,
        "kl_nats_mean": json_clean(kl.mean()) if n else None,
        "kl_nats_p50": json_clean(np.percentile(kl, 50)) if n else None,
        "kl_nats_p95": json_clean(np.percentile(kl, 95)) if n else None,
        "max_kl_reference_top_token": comp.token_text(int(c["top1_ref"][imax])) if n else None,
        "max_kl_candidate_top_token": comp.token_text(int(c["top1_cand"][imax])) if n else None,
        "max_kl_source_id": str(c["item_id"][imax]) if n else None,
        "max_kl_position": int(c["position"][imax]) if n else None,
        "paired_prompts": len(comp.items),
        "shared_reference_mass_mean": json_clean(np.mean(c["shared_reference_mass"])) if n else None,
        "top1_match_rate": json_clean(match.mean()) if n else None,
        "top1_matches": int(match.sum()),
        "top1_mismatches": int((~match).sum()),
        # Ours.
        "positions": n,
        "top1_disagreement": overall.get("top1_disagreement"),
        # the divergence entries of the overall group: Stats
        "metrics": {k: v for k, v in overall.items() if isinstance(v, dict) and k != "top1_disagreement"},  # type: ignore[misc]
    }
    # the fields whose keys are built from names (Summary says which); written through a plain view
    named = cast("dict[str, Any]", summary)
    for key in ("ppl_ref", "ppl_cand", "ppl_ratio", "nll_ref_mean", "nll_cand_mean"):
        if key in overall:
            named[key] = cast("dict[str, Any]", overall)[key]
    if n:
        named.update(_interval_fields(c))
    if noise_floor:
        summary["noise_floor"] = noise_floor
        floor = noise_floor.get("kl_nats_mean")
        summary["kl_mean_x_noise_floor"] = (kl.mean() / floor) if (n and floor) else None
    if comp.served_floor:  # served sides captured again with other batch mates (servedfloor.py)
        from ..sources.served_floor import summary_fields

        named.update(summary_fields(float(kl.mean()) if n else None, comp.served_floor))
    return summary


def _interval_fields(c: dict[str, Any]) -> dict[str, Any]:
    """Proven intervals (bounded methods): the mean of the bounds bounds the mean."""
    from ..store.compact import INTERVAL_COLUMNS

    out: dict[str, Any] = {}
    for lo, hi in INTERVAL_COLUMNS.values():
        if lo in c:
            out[f"{lo}_mean"] = json_clean(np.mean(c[lo]))
            out[f"{hi}_mean"] = json_clean(np.mean(c[hi]))  # inf (JSON null): no finite upper bound
            name = lo[:-len('_lower_nats')]
            width = float(np.mean(np.asarray(c[hi]) - np.asarray(c[lo])))
            out[f"{name}_interval_width_mean"] = json_clean(width)
            # a real model's unstored tail can leave the upper end far off while the lower
            # end is within ~1 % (bench/RESULTS.md): say so when the width exceeds the
            # estimate itself, so the page reads the interval from below
            est = float(np.mean(c[lo.replace("_lower", "")])) if lo.replace("_lower", "") in c else float("nan")
            out[f"{name}_upper_uninformative"] = bool(not np.isfinite(width) or width > abs(est))
    return out


def _group_rows(comp: Comparison, c: dict[str, Any], item_index: np.ndarray, item_tags: dict, tag_of_row: list, *,
                ranges: Sequence[int], n_boot: int, seed: int) -> tuple[list[GroupStats], list[GroupStats], list[GroupStats]]:
    """report.json's ``ranges``, ``tags`` and ``segments`` (adding the ``segment`` column to
    ``c`` where the vocabulary gives one)."""
    kw = {"n_boot": n_boot, "seed": seed}
    pos = np.asarray(c["position"])
    range_rows = by_groups(c, item_index, range_masks(pos, ranges), **kw)
    all_tags = sorted({t for tags in item_tags.values() for t in tags})  # an item's tag is a group even where it has no position
    tag_rows = by_groups(
        c, item_index, ((t, np.array([t in tags for tags in tag_of_row], dtype=bool)) for t in all_tags), **kw
    )
    seg_rows: list[GroupStats] = []
    if comp.vocab is not None:
        labels = _segment_labels(comp)
        if labels is not None:
            c["segment"] = labels
            seg_rows = by_groups(c, item_index, segment_masks(labels), **kw)
    return range_rows, tag_rows, seg_rows


def _item_rows(comp: Comparison, c: dict[str, Any], item_index: np.ndarray) -> list[GroupStats]:
    """report.json's ``items``: one group per item, without bootstrap."""
    item_rows: list[GroupStats] = []
    for it in comp.items:
        mask = c["item_id"] == it.id
        g = summarize_group({k: np.asarray(v)[mask] for k, v in c.items()}, item_index[mask], n_boot=0)
        item_rows.append({"id": it.id, "tags": it.tags, **g})
    return item_rows


def _add_token_texts(comp: Comparison, c: dict[str, Any], tag_of_row: list) -> None:
    """The table's text columns: every row's tags, and the text of each token id column."""
    c["tags"] = np.array([list(t) for t in tag_of_row], dtype=object)
    c["reference_top_token"] = np.array([comp.token_text(int(t)) for t in c["top1_ref"]], dtype=object)
    c["candidate_top_token"] = np.array([comp.token_text(int(t)) for t in c["top1_cand"]], dtype=object)
    c["token"] = np.array([comp.token_text(int(t)) for t in c["token_id"]], dtype=object)
    for side in ("ref", "cand"):
        if f"top5_{side}_ids" in c:
            c[f"top5_{side}_tokens"] = np.array(
                [[comp.token_text(int(t)) for t in row] for row in np.asarray(c[f"top5_{side}_ids"])], dtype=object
            )


def _segment_labels(comp: Comparison) -> np.ndarray | None:
    """Segment (think / tool_call / answer) of every compared position, from the teacher text."""
    vocab = comp.vocab
    if vocab is None:
        return None
    scheme = vocab_scheme(vocab)
    out: list[str] = []
    for it in comp.items:
        if any(t >= len(vocab) for t in it.teacher_ids):
            return None
        labels = item_segments(vocab, it.teacher_ids, scheme=scheme)
        out.extend(labels[p] for p in it.positions)
    arr = np.array(out, dtype=object)
    return arr if len(arr) == comp.n else None


def _rows(comp: Comparison, c: dict) -> list[dict]:
    """One dict per position: the seed's row fields first, then ours alphabetically."""
    # Each column to Python values once (tolist), not one numpy scalar at a time; the
    # rows are then zipped from the column lists with one key order for all of them.
    cols = {k: json_clean(np.asarray(c[k]).tolist()) for k in c if k != "item_id"}
    ids = [str(x) for x in c["item_id"]]
    cols["reference_top_token"] = [comp.token_text(int(t)) for t in cols["top1_ref"]]
    cols["candidate_top_token"] = [comp.token_text(int(t)) for t in cols["top1_cand"]]
    cols["token"] = [comp.token_text(int(t)) for t in cols["token_id"]]
    cols["item_id"] = ids
    cols["source_id"] = ids
    order = [k for k in SEED_ROW_FIELDS if k in cols]
    order += sorted(k for k in cols if k not in order)
    return [dict(zip(order, vals)) for vals in zip(*(cols[k] for k in order))]


def write_parquet(path: Path, columns: dict[str, np.ndarray]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from . import arrow_columns as ac  # pa.array would import pandas (seconds per compare)

    first = ["item_id", "tags", "position", "token_id", "token"]
    names = first + sorted(k for k in columns if k not in first)
    arrays = []
    for k in names:
        v = columns[k]
        if k in ("tags", "top5_ref_tokens", "top5_cand_tokens"):
            arrays.append(ac.string_lists([[str(t) for t in x] for x in v]))
        elif getattr(v, "ndim", 1) == 2:
            arrays.append(ac.from_numpy(v))
        elif v.dtype == object:
            arrays.append(ac.strings([str(x) for x in v]))
        else:
            arrays.append(ac.from_numpy(v))
    pq.write_table(pa.Table.from_arrays(arrays, names=names), path)


def write_report_dir(
    out: str | Path,
    report: Report,
    columns: dict[str, np.ndarray],
    *,
    markdown: str,
    extra_files: dict[str, bytes] | None = None,
    inputs: Sequence[str | Path] = (),
) -> Path:
    """Write report.json, tokens.parquet, report.md (+ extras) into a temporary directory
    and swap it in: ``out`` must be new, empty or a REPORT, and none of ``inputs``
    (see :func:`logitdiff.store.files.writing`)."""
    from ..store.files import Kind, writing

    out = Path(out)
    text = report_json(report, str(out / "report.json"))
    with writing(out, Kind.REPORT, inputs=inputs) as tmp:
        (tmp / "report.json").write_text(text)
        write_parquet(tmp / "tokens.parquet", columns)
        (tmp / "report.md").write_text(markdown)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return out


def update_report_dir(out: str | Path, report: Report, files: dict[str, bytes], remove: Sequence[str] = ()) -> None:
    """Replace report.json, add/replace ``files`` and delete ``remove`` in an existing REPORT directory.

    Every file is written to a temporary name first and only then renamed into place
    (:func:`logitdiff.store.files.atomic_path`), so a failure while producing the new contents
    leaves the old report untouched.
    """
    out = Path(out)
    payload = {"report.json": report_json(report, str(out / "report.json")).encode(), **files}
    with ExitStack() as renames:  # renamed when every file is written, none on a failure
        for name, data in payload.items():
            tmp = renames.enter_context(atomic_path(out / name))
            try:
                tmp.write_bytes(data)
            except OSError as e:
                raise write_error(out / name, e) from None
    for name in remove:
        (out / name).unlink(missing_ok=True)


def rewrite_report_dir(out: str | Path, report: Report, columns: dict[str, np.ndarray], files: dict[str, bytes],
                       remove: Sequence[str] = ()) -> None:
    """An existing REPORT brought up to ``report`` (e.g. with flips and correctness added):
    report.json, ``files``, and report.md and report.html rendered again from the report and
    ``columns`` (its tokens), all written at once as :func:`update_report_dir` does;
    ``remove`` deleted."""
    from .html import plotly_src_for, render_html
    from .markdown import render_markdown

    run = run_of_report(out)  # a REPORT of a RUN keeps loading the RUN's shared plotly.js
    page = render_html([report], [columns], paths=[str(out)], plotly_src=None if run is None else plotly_src_for(out, run))
    rendered = {"report.md": render_markdown(report).encode(), "report.html": page.encode()}
    update_report_dir(out, report, {**files, **rendered}, remove=remove)


def run_of_report(report_dir: str | Path) -> Path | None:
    """The RUN directory (``logitdiff run``'s OUT) whose reports/ holds ``report_dir`` and
    which has a shared plotly.js for its pages; None for a REPORT written alone (or by a
    run from before the shared file)."""
    from .html import PLOTLY_FILE

    out = Path(report_dir).resolve().parent.parent
    if Path(report_dir).resolve().parent.name != "reports" or not (out / "summary.json").is_file():
        return None
    return out if (out / PLOTLY_FILE).is_file() else None


def write_candidate_page(report_dir: str | Path, summary=None, *, plotly_src: str | None = None) -> Path:
    """REPORT/report.html: the page of this one candidate (``summary``: the run's summary.json,
    for the cross-engine floor), from its report.json and tokens.parquet; self-contained, or
    loading plotly.js from ``plotly_src`` (relative to the page). The page is written
    to a temporary name and renamed into place; nothing else in the REPORT changes."""
    from .html import load_tokens, render_html

    from ..store.files import same_directory

    report_dir = Path(report_dir)
    with same_directory(report_dir):  # report.json and tokens.parquet of one version of the REPORT
        report, tokens = load_report(report_dir), load_tokens(report_dir / "tokens.parquet")
    page = render_html([report], [tokens], summary=summary, paths=[str(report_dir)], plotly_src=plotly_src)
    atomic_write_bytes(report_dir / "report.html", page.encode("utf-8"))
    return report_dir / "report.html"


def read_columns(report_dir: str | Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Columns of a REPORT's tokens.parquet as numpy arrays."""
    path = Path(report_dir) / "tokens.parquet"
    if not path.exists():
        from ..errors import LogitdiffError

        raise LogitdiffError(f"{path}: not found (is {report_dir} a logitdiff REPORT directory?)")
    from .arrow_columns import read_parquet, to_numpy

    # a schema-1.x report's columns under their 2.0 names (contracts.migrate_columns)
    def stored(file_names: list[str]) -> list[str] | None:
        in_file = migrate_columns({k: k for k in file_names})  # 2.0 name -> the name in the file
        return [in_file.get(k, k) for k in names] if names else None

    t = read_parquet(path, stored)
    return migrate_columns({k: to_numpy(t.column(k)) for k in t.column_names})


def read_report_and_columns(report_dir: str | Path, names: Sequence[str] | None = None) -> tuple[Report, dict[str, np.ndarray]]:
    """report.json and tokens.parquet's columns of one version of a REPORT directory: a
    one-line error when another command (``compare --out`` the same REPORT) replaced it
    between the two reads, never figures of one report beside tokens of another."""
    from ..store.files import same_directory

    with same_directory(report_dir):
        return read_report(report_dir), read_columns(report_dir, names)


def read_report(report_dir: str | Path) -> Report:
    """report.json of a REPORT directory, checked (:func:`logitdiff.contracts.load_report`)."""
    return load_report(Path(report_dir))
