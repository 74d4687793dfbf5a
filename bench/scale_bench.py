"""The scale benchmark: V = 248,320 and long outputs, peak memory and wall time of
every streaming command.

A random Llama (hidden 128, 2 layers) on the bundled tokenizer widened to exactly 248,320
tokens is built offline (tests/_models.py: ``make_wide_llama``), exported to GGUF F32 and
quantized to Q8_0. For one output length N (``--tokens``) and ``--items`` items, each step
runs as its own ``logitdiff`` process (under ``prlimit --as``) and reports its peak RSS
(VmHWM, read by the process itself at exit) and wall time:

    load-*        open the source and generate one token: the model's own footprint
    teacher       (with --ref-teacher) capture gguf:Q8_0,threads=1 --store topk:64: greedy
                  generation of the output + scoring of every position, in one command,
                  by the source that generates fastest on a CPU (llama.cpp, one thread)
    ref           capture hf:M (bf16, stored as bf16 bits) — greedy generation + scoring;
                  with --ref-teacher, teacher-forced on the ``teacher`` run's output instead
    cand-hf       capture hf:M,dtype=float16 --reference ref (stored float16)
    cand-gguf     capture gguf:Q8_0 --reference ref (--store full, or topk:64 with --gguf-topk)
    live          compare ref hf:M,dtype=float16 (scored live, nothing stored)
    compare       compare ref cand-hf
    topk-error    topk-error ref cand-hf --top-k 8,64,1024
    flips         flips REPORT (1 branch, edit similarity)

and bytes on disk per position of each store. Results are appended as JSON lines to
``--json``; the peak above the model is VmHWM(step) - VmHWM(load of that source).

    python bench/scale_bench.py --tokens 2048 --work /tmp/scale --json bench/scale_results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V = 248_320


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def child(argv: list[str]) -> int:
    """Run one logitdiff command (or ``load SPEC``) in this process; write VmHWM to $SCALE_OUT."""
    out = os.environ["SCALE_OUT"]
    rc = 0
    if argv[0] == "load":
        from logitdiff.sources import open_source

        with open_source(argv[1]) as src:
            src.generate(src.render(_item(0)), 1)
    else:
        from logitdiff.cli import main

        rc = main(argv)
    Path(out).write_text(json.dumps({"vmhwm": _vm("VmHWM"), "rc": rc}))
    return rc


def _item(k: int):
    from logitdiff.workload import Item

    return Item(id=f"item{k}", prompt=f"Item {k}: def fibonacci(n):\n    ")


def run_step(name: str, args: list[str], work: Path, limit: int, results: list, extra: dict) -> dict:
    out = work / f".{name}.vm.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "SCALE_OUT": str(out), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}
    cmd = ["prlimit", f"--as={limit}", sys.executable, str(Path(__file__).resolve()), "--child", *args]
    t0 = time.perf_counter()
    log = work / f".{name}.log"
    with open(log, "w") as errf:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf)
        peak = 0
        while p.poll() is None:  # VmHWM as it grows, so a step that cannot finish still says where it stood
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    hwm = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:")), 0)
            except OSError:
                hwm = 0
            if hwm > peak:
                peak = hwm
                (work / f".{name}.progress").write_text(json.dumps({"vmhwm_so_far": peak, "elapsed_s": round(time.perf_counter() - t0)}))
            time.sleep(2)
    wall = time.perf_counter() - t0
    p.stderr = log.read_text()
    vm = json.loads(out.read_text()) if out.exists() else {"vmhwm": None, "rc": p.returncode}
    rec = {"step": name, "wall_s": round(wall, 2), "vmhwm_bytes": vm["vmhwm"], "rc": p.returncode, "args": args, **extra,
           "loadavg_end": os.getloadavg()[0]}
    if p.returncode != 0:
        rec["stderr_tail"] = p.stderr[-2000:]
    print(json.dumps(rec), flush=True)
    results.append(rec)
    return rec


def record(path: str, rec: dict) -> None:
    """Append one step's record as soon as it is complete (a long run that is stopped keeps its finished steps)."""
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def build_models(work: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import make_wide_llama

    from logitdiff.sources.gguf_export import export_gguf
    from logitdiff.sources.quantize import quantize

    m = work / "model"
    if not (m / "config.json").exists():
        make_wide_llama(m, max_positions=40_960, heads=2, kv_heads=1, dtype="bfloat16", never_eos=True)
    f32 = work / "model-F32.gguf"
    q8 = work / "model-Q8_0.gguf"
    if not q8.exists():
        if not f32.exists():
            export_gguf(m, f32, "F32")
        quantize(f32, q8, "Q8_0")
        f32.unlink()
    return m, q8


def run_bytes(run: Path) -> dict:
    man = json.loads((run / "manifest.json").read_text())
    data = sum((run / "chunks" / c["data"]).stat().st_size for c in man["chunks"])
    return {"store": man["settings"]["store"], "dtype": man["settings"].get("dtype"), "positions": man["n_positions"],
            "data_bytes": data, "bytes_per_position": data / max(1, man["n_positions"]), "chunks": len(man["chunks"])}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, required=True, help="output length N per item")
    ap.add_argument("--items", type=int, default=1)
    ap.add_argument("--work", default="/tmp/logitdiff-scale")
    ap.add_argument("--json", default=str(ROOT / "bench" / "scale_results.jsonl"))
    ap.add_argument("--steps", default="load,ref,cand-hf,cand-gguf,live,compare,topk-error,flips")
    ap.add_argument("--mem-limit", type=int, default=8 << 30, help="prlimit --as per step (bytes)")
    ap.add_argument("--gguf-topk", action="store_true", help="capture the gguf candidate with --store topk:64 (saves disk)")
    ap.add_argument("--ref-teacher", action="store_true",
                    help="generate the output with the gguf source (step 'teacher') and capture the hf reference "
                         "teacher-forced on it: transformers' greedy decoding at V = 248,320 costs ~0.1 s of CPU per "
                         "token, too slow for 32,768 tokens on a shared 2-core machine")
    ap.add_argument("--keep", action="store_true", help="keep the runs (default: delete them at the end)")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    steps = set(a.steps.split(","))
    m, q8 = build_models(work)
    n = a.tokens
    ctx = n + 64
    ref_spec = f"hf:{m},batch={a.items}"
    cand_spec = f"hf:{m},dtype=float16,batch={a.items}"
    gguf_spec = f"gguf:{q8},n_ctx={ctx}"
    wl = work / f"w{a.items}.jsonl"
    wl.write_text("".join(json.dumps(_item(k).to_json()) + "\n" for k in range(a.items)))
    tag = f"n{n}x{a.items}"
    ref, cand, gg, rep, teach = (work / f"{x}-{tag}" for x in ("ref", "cand", "gguf", "report", "teacher"))
    base = {"tokens": n, "items": a.items, "vocab": V}
    res: list = []
    lim = a.mem_limit

    def step(name: str, args: list[str], disk: Path | None = None) -> None:
        rec = run_step(name, args, work, lim, res, base)
        if disk is not None and rec["rc"] == 0:
            rec["disk"] = run_bytes(disk)
        record(a.json, rec)

    if "load" in steps:
        for name, spec in (("load-hf-bf16", ref_spec), ("load-hf-f16", cand_spec), ("load-gguf-q8", gguf_spec)):
            step(name, ["load", spec])
    if a.ref_teacher and "teacher" in steps:
        fast = f"{gguf_spec},threads=1"
        step("load-gguf-q8-t1", ["load", fast])
        step("teacher", ["capture", fast, "--workload", str(wl), "--max-tokens", str(n), "--store", "topk:64",
                        "--out", str(teach), "--overwrite"], disk=teach)
    if "ref" in steps:
        src = ["--reference", str(teach)] if a.ref_teacher else ["--workload", str(wl), "--max-tokens", str(n)]
        step("ref", ["capture", ref_spec, *src, "--out", str(ref), "--overwrite"], disk=ref)
    if "cand-hf" in steps:
        step("cand-hf", ["capture", cand_spec, "--reference", str(ref), "--out", str(cand), "--overwrite"], disk=cand)
    if "cand-gguf" in steps:
        store = ["--store", "topk:64"] if a.gguf_topk else []
        step("cand-gguf", ["capture", gguf_spec, "--reference", str(ref), "--out", str(gg), "--overwrite", *store], disk=gg)
        shutil.rmtree(gg, ignore_errors=True)
    if "live" in steps:
        step("live", ["compare", str(ref), cand_spec, "--out", str(rep) + "-live", "--bootstrap", "100", "--no-rows"])
    if "compare" in steps:
        step("compare", ["compare", str(ref), str(cand), "--out", str(rep), "--bootstrap", "100", "--no-rows"])
    if "topk-error" in steps:
        step("topk-error", ["topk-error", str(ref), str(cand), "--top-k", "8,64,1024", "--json", str(work / f"topk-{tag}.json")])
    if "flips" in steps and rep.exists():
        step("flips", ["flips", str(rep), "--max-branches", "1", "--max-tokens", "64", "--similarity", "edit",
                       "--no-correctness"])
    if not a.keep:
        for p in (ref, cand, gg):
            shutil.rmtree(p, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
