"""End to end beside ``llama-perplexity --kl-divergence`` on the same text (issue 40).

Both tools do the same job: a reference and one candidate GGUF, teacher-forced on the same
text in llama-perplexity's chunks (``-c CTX``: the second half of each chunk scored), the
mean KL of the candidate from the reference at every scored position.

(a) llama.cpp, two commands as its docs give them::

        llama-perplexity -m REF  --kl-divergence-base BASE -f TEXT -c CTX -t T [--chunks N] [--no-repack -fa off]
        llama-perplexity -m CAND --kl-divergence-base BASE --kl-divergence -f TEXT -c CTX -t T [--chunks N] [--no-repack -fa off]

Both sides use one weight layout: llama.cpp's repacked one (``--repack``: llama-perplexity's
default, logitdiff's ``gguf:...,repack=true``) or the plain one (llama-perplexity
``--no-repack -fa off``, logitdiff's default: llama-cpp-python runs without flash attention),
so the engines do the same arithmetic.

(b) logitdiff, two commands::

        logitdiff capture gguf:REF,threads=T --workload text:TEXT --ctx CTX [--chunks N] --out WORK/ref --overwrite
        logitdiff compare WORK/ref gguf:CAND,threads=T --out WORK/report        (candidate live, nothing stored)

Each repetition runs (a) and (b) back to back, the order alternating, in one invocation;
the ratio is median(b) / median(a) of the end-to-end wall times (each side's two commands
summed, every process start included). Both mean KL figures are printed side by side:
llama.cpp's "Mean KLD" is computed from its 16-bit base rows with every entry at or below
max - 16 nats dropped, logitdiff's exactly from the full float32 rows, so they differ by
that (docs/bounds.md section 4) and by the float rounding of two batch layouts.

The GGUF metadata read (``sources/gguf_meta.py``, worked on separately) is timed apart:
one process that only reads each model's metadata, beside the runs.

    python bench/perplexity_parity.py --ref REF.gguf --cand CAND.gguf --text TEXT [--ctx 512] [--chunks N] \
        [--threads 2] [--runs 3] [--work DIR] [--llama-perplexity PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EXE = Path.home() / ".cache" / "logitdiff" / "tools" / "llama-server" / "current" / "bin" / "llama-perplexity"


CPU: dict[str, float] = {}  # CPU seconds (user + sys) of the last command of each tool, beside its wall time


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Wall seconds of ``cmd``; its CPU seconds (user + sys, from the children's rusage) are
    added to CPU["last"]: on a shared, oversubscribed machine the wall time is mostly waiting
    for a core, the CPU time is the work done."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["last"] = CPU.get("last", 0.0) + (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{(res.stdout + res.stderr)[-3000:]}")
    return dt, res.stdout + res.stderr


def with_cpu(fn):
    """``fn()``'s result and the CPU seconds its commands took."""
    CPU["last"] = 0.0
    out = fn()
    return out, CPU["last"]


def llama_side(a, work: Path) -> tuple[list[float], float]:
    base = work / "base.kld"
    common = ["-f", str(a.text), "-c", str(a.ctx), "-t", str(a.threads)] + (["--chunks", str(a.chunks)] if a.chunks else [])
    # the plain layout also without flash attention: llama-cpp-python's Llama (logitdiff's gguf:) runs
    # with it off, llama-perplexity's default (auto) turns it on on the CPU
    common += [] if a.repack else ["--no-repack", "-fa", "off"]
    t1, _ = timed([str(a.llama_perplexity), "-m", str(a.ref), "--kl-divergence-base", str(base), *common])
    t2, out = timed([str(a.llama_perplexity), "-m", str(a.cand), "--kl-divergence-base", str(base), "--kl-divergence", *common])
    m = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", out)
    if not m:  # llama.cpp's log thread sometimes loses the last lines at exit on a loaded machine: the figure
        # is read from a rerun (deterministic), the time stays the first run's
        cpu = CPU["last"]
        _, out = timed([str(a.llama_perplexity), "-m", str(a.cand), "--kl-divergence-base", str(base), "--kl-divergence", *common])
        CPU["last"] = cpu  # nor its CPU seconds
        m = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", out)
    if not m:
        sys.exit("llama-perplexity printed no 'Mean KLD' (fewer than 100 scored positions?)\n" + out[-2000:])
    return [t1, t2], float(m.group(1))


def logitdiff_side(a, work: Path, src: Path = ROOT / "src") -> tuple[list[float], float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    py = [sys.executable, "-m", "logitdiff.cli"]
    chunks = ["--chunks", str(a.chunks)] if a.chunks else []
    opt = f",threads={a.threads}" + (",repack=true" if a.repack else "")
    t1, _ = timed([*py, "capture", f"gguf:{a.ref}{opt}", "--workload", f"text:{a.text}", "--ctx", str(a.ctx),
                   *chunks, "--out", str(work / "ref"), "--overwrite"], env)
    t2, _ = timed([*py, "compare", str(work / "ref"), f"gguf:{a.cand}{opt}", "--out", str(work / "report"),
                   *a.compare_args], env)
    report = json.loads((work / "report" / "report.json").read_text())
    return [t1, t2], float(report["summary"]["kl_nats_mean"])


def metadata_seconds(path: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = ("import time; t=time.perf_counter(); from logitdiff.sources.gguf_meta import gguf_metadata; "
            f"gguf_metadata({str(path)!r}); print(time.perf_counter()-t)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout)


def machine() -> str:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", type=Path, required=True)
    ap.add_argument("--cand", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/perplexity_parity"))
    ap.add_argument("--llama-perplexity", type=Path, default=DEFAULT_EXE)
    ap.add_argument("--repack", action="store_true",
                    help="both with llama.cpp's weight repacking (llama-perplexity's default; logitdiff gguf:...,repack=true); "
                         "without it both use the plain layout (llama-perplexity --no-repack; logitdiff's default)")
    ap.add_argument("--before-src", type=Path, default=None,
                    help="another checkout's src/ (e.g. the commit before an optimisation), timed as a third side")
    ap.add_argument("--compare-args", nargs=argparse.REMAINDER, default=[], help="extra arguments of logitdiff compare")
    a = ap.parse_args()
    if not a.llama_perplexity.is_file():
        sys.exit(f"{a.llama_perplexity}: not built (bash scripts/build_llama_server.sh builds it)")
    a.work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    print(f"machine: {machine()}; load average before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}")
    print(f"text {a.text} ({a.text.stat().st_size} bytes), -c {a.ctx}, chunks {a.chunks or 'all'}, threads {a.threads}, "
          f"weights {'repacked (both)' if a.repack else 'plain layout (both: llama-perplexity --no-repack)'}")
    rows = []
    for k in range(a.runs):
        sides = [("llama", lambda: llama_side(a, a.work)), ("logitdiff", lambda: logitdiff_side(a, a.work))]
        if a.before_src:
            sides.append(("before", lambda: logitdiff_side(a, a.work, a.before_src)))
        sides = sides[k % len(sides):] + sides[: k % len(sides)]  # the order rotates run by run
        got = {name: with_cpu(fn) for name, fn in sides}
        cpu = {name: c for name, (_, c) in got.items()}
        (lt, lkl), (dt, dkl) = got["llama"][0], got["logitdiff"][0]
        bt, bkl = got["before"][0] if "before" in got else ([float("nan")] * 2, float("nan"))
        rows.append((sum(lt), sum(dt), lt, dt, lkl, dkl, sum(bt), bkl, cpu))
        print(f"run {k + 1}: llama-perplexity {sum(lt):.2f} s (base {lt[0]:.2f} + kld {lt[1]:.2f}), "
              f"logitdiff {sum(dt):.2f} s (capture {dt[0]:.2f} + compare {dt[1]:.2f}), ratio {sum(dt) / sum(lt):.3f}"
              + (f"; before {sum(bt):.2f} s (capture {bt[0]:.2f} + compare {bt[1]:.2f}), ratio {sum(bt) / sum(lt):.3f}"
                 if a.before_src else "")
              + f"; mean KL llama.cpp {lkl:.6f}, logitdiff {dkl:.6f}" + (f", before {bkl:.6f}" if a.before_src else "")
              + "; CPU s " + ", ".join(f"{n} {c:.2f}" for n, c in cpu.items()),
              flush=True)
    med_l = statistics.median(r[0] for r in rows)
    med_d = statistics.median(r[1] for r in rows)
    load1 = os.getloadavg()
    meta = [metadata_seconds(p) for p in (a.ref, a.cand)]
    print(f"median: llama-perplexity {med_l:.2f} s, logitdiff {med_d:.2f} s, ratio {med_d / med_l:.3f} "
          f"(per-run ratios {', '.join(f'{r[1] / r[0]:.3f}' for r in rows)})")
    cpu_med = {n: statistics.median(r[8][n] for r in rows) for n in rows[0][8]}
    print("median CPU seconds (user + sys): " + ", ".join(f"{n} {c:.2f}" for n, c in cpu_med.items())
          + f"; ratio logitdiff / llama-perplexity {cpu_med['logitdiff'] / cpu_med['llama']:.3f}"
          + (f", before / llama-perplexity {cpu_med['before'] / cpu_med['llama']:.3f}" if "before" in cpu_med else ""))
    if a.before_src:
        med_b = statistics.median(r[6] for r in rows)
        print(f"median before ({a.before_src}): {med_b:.2f} s, ratio {med_b / med_l:.3f} "
              f"(per-run ratios {', '.join(f'{r[6] / r[0]:.3f}' for r in rows)})")
    print(f"mean KL: llama.cpp 'Mean KLD' {rows[-1][4]:.6f}, logitdiff kl_nats_mean {rows[-1][5]:.6f} "
          f"(relative difference {abs(rows[-1][5] - rows[-1][4]) / rows[-1][4]:.2%})")
    print(f"GGUF metadata read alone (a process each, import included): ref {meta[0]:.2f} s, cand {meta[1]:.2f} s")
    print(f"load average after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")


if __name__ == "__main__":
    main()
