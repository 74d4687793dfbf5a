"""Defaults the CLI's ``--help`` shows, defined once here so that building the parser imports
no engine module (capture, flips, speculation, layers, consequences: ~0.2 s of every
command's start, more on a loaded machine). The engine modules import them from here."""

# capture: tokens generated per item when the workload does not say; items per score_many call
# (one block of the batch layout)
DEFAULT_MAX_TOKENS = 64
SCORE_BATCH = 8

# flips: a flip's realignment (see flips.py for why these sizes)
MIN_RUN = 4
MAX_SHIFT = 8
MAX_DETOUR = 8

# consequences: branches per candidate at most (the highest-KL flips are kept): `run` and `flips` alike
DEFAULT_MAX_BRANCHES = 24

# layers: the floor measured by re-running the reference
FLOOR_RERUN = "rerun"

# grading: similarity thresholds of "same answer" (why these values: grading.py, docs/flips.md)
DEFAULT_THRESHOLDS = {"minilm": 0.70, "edit": 0.45}

# speculation
DEFAULT_N_PREDICT = 256
DEFAULT_TOP_K = 20
DEFAULT_FLOOR_ITEMS = 8
DEFAULT_SHAPE_WIDTH = 4  # llama-server's default draft (--spec-draft-n-max 3) + the target's token

# flips: where to read how far the classifier's outcomes hold when checked (`flips --help` and
# the page point there; the measured agreement lives in docs/flips.md, not in the code, and
# tests/test_flips_labelled.py classifies the labelled branches again and requires docs' figures)
FLIP_AGREEMENT_TEXT = (
    "How far the classes hold when someone checks: docs/flips.md (\"Recovered, checked by a reader\") gives how "
    "often a blind reader shown a recovered branch sees the reference's text come back, and how the rule-decided "
    "classes compare with blind readers' labels. Meaning is judged only with --judge; each branch's decided_by says "
    "what decided it and, for a diverged one, what was observed."
)

# What `--help` says of the sandbox (flips; run): here, not in flips/sandbox.py, so that building
# the CLI's parser imports no flips module. Keep in step with flips/sandbox.py's docstring and docs/flips-and-correctness.md.
SANDBOX_HELP = """\
Executed tool calls (items with a tools_module) run one per fresh subprocess, in an empty
temporary directory, with a timeout, memory/CPU/file-size limits and a Python audit hook.
On Linux the kernel also confines the process where it allows: Landlock (writes only inside
that directory), seccomp (no socket of any address family, Unix included; no new
processes; no chmod/chown/utime/xattr changes anywhere; prlimit, priority, affinity and
signals only on itself; no System V IPC; no terminal ioctls), namespaces of its own (network:
no interface up; IPC; mount: a 64 MiB tmpfs holds all it writes), at most 64 tasks, no
terminal and no capabilities. A tool's result is read up to 16 MiB and 100 levels deep; more
fails that call. Any part the kernel refuses (old kernel, container profile, no user
namespaces) falls back to the audit hook alone, which ctypes, C extensions and dir_fd paths
go around, or to nothing: that part is NOT contained. Every execution records which parts
held ("containment" in flips.parquet's signals). Reading files is never restricted. For
hostile code, use a container as well."""

# flips: what `--help` says of --judge (flips; run): here so that building the parser imports no
# flips module. Keep in step with flips/judge.py's docstring and docs/flips.md ("Judges").
JUDGE_HELP = (
    "a source that generates (served:URL, gguf:PATH, hf:DIR, builtin:...) asked, with a fixed prompt "
    "(docs/flips.md, Judges), whether a diverged branch and the reference's continuation say the same thing: "
    "YES -> benign, NO -> meaning_changed, any other answer leaves it diverged (recorded). "
    "The report names the judge and its agreement with blind readers where measured (default: no judge; "
    "no branch is called benign or meaning_changed)"
)
