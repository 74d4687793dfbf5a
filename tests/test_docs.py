"""The docs hold: the site in docs/ builds with `mkdocs build --strict` (a broken link or anchor
fails it), every generated table is the one its registry gives today, and README keeps its
promises to a newcomer — at most 300 lines, every relative link pointing at a file and anchor
that exist, every shell command in it run as written."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(project / "mkdocs.yml"),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


def _copy_site_sources(dest: Path) -> Path:
    shutil.copy2(ROOT / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", dest / "docs")
    return dest


# ----------------------------------------------------------------------------- the site
def test_docs_site_builds_strictly(tmp_path):
    r = _mkdocs_build(ROOT, tmp_path / "site")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "WARNING" not in out, out
    # every page of the nav became a page of the site
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 18
    for stem in pages:
        built = tmp_path / "site" / ("index.html" if stem == "index" else f"{stem}/index.html")
        assert built.is_file(), f"docs/{stem}.md was not built"
    assert "Reports and gates" in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("breakage", ["missing page", "missing anchor", "page left out of the nav", "link out of docs/"])
def test_strict_build_fails_on_a_broken_link(tmp_path, breakage):
    """The configuration really is strict: each way a link can break fails the build, naming it."""
    project = _copy_site_sources(tmp_path)
    page = project / "docs" / "reports.md"
    text = page.read_text(encoding="utf-8")
    if breakage == "missing page":
        page.write_text(text + "\nSee [nowhere](no-such-page.md).\n", encoding="utf-8")
        needle = "no-such-page.md"
    elif breakage == "missing anchor":
        page.write_text(text + "\nSee [the gates](compare.md#no-such-heading).\n", encoding="utf-8")
        needle = "no-such-heading"
    elif breakage == "page left out of the nav":
        (project / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
        needle = "orphan.md"
    else:
        page.write_text(text + "\nSee [the results](../bench/RESULTS.md).\n", encoding="utf-8")
        needle = "RESULTS.md"
    r = _mkdocs_build(project, tmp_path / "site")
    assert r.returncode != 0 and needle in r.stdout + r.stderr, r.stdout + r.stderr


# ----------------------------------------------------------------------------- generated tables
def test_generated_tables_are_current():
    assert _docs_tables().stale() == [], "run scripts/docs_tables.py"


def test_a_stale_or_missing_table_is_caught(tmp_path):
    dt = _docs_tables()
    for rel in dt.FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    assert dt.stale(tmp_path) == []
    # one changed cell in each generated table is reported, naming the file
    edits = {"docs/sources.md": ("| `hf:` | `dtype` |", "| `hf:` | `dtypes` |"),
             "docs/compare.md": ("| `kl_mean` |", "| `kl_average` |"),
             "docs/reports.md": ("| `kl_mean` |", "| `kl_avg` |"),
             "docs/architecture.md": ("| numerics |", "| maths |"),
             "README.md": ("| store |", "| runs |"),
             "docs/flips.md": ("Answer YES or NO.\n```", "Answer YES or NO!\n```")}
    assert set(edits) == set(dt.FILES)
    for rel, (old, new) in edits.items():
        path = tmp_path / rel
        good = path.read_text(encoding="utf-8")
        assert good.count(old) == 1, (rel, old)
        path.write_text(good.replace(old, new), encoding="utf-8")
        assert dt.stale(tmp_path) == [rel]
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--check", "--root", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and f"{rel}: a generated table differs" in r.stderr, r.stderr
        # rewriting restores exactly the generated text
        assert subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--root", str(tmp_path)],
                              capture_output=True, timeout=120).returncode == 0
        assert path.read_text(encoding="utf-8") == good
    # a file whose markers are gone is refused whole, naming it and the marker, and left as it was
    path = tmp_path / "docs" / "reports.md"
    broken = path.read_text(encoding="utf-8").replace("<!-- generated:gates:end -->", "")
    path.write_text(broken, encoding="utf-8")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "docs/reports.md" in r.stderr and "generated:gates:end" in r.stderr, r.stderr
    assert path.read_text(encoding="utf-8") == broken


def test_architecture_table_has_one_row_per_stage():
    dt = _docs_tables()
    table = dt.architecture_table()
    names = [name for name, _ in dt.stages()]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows == names and len(names) >= 14
    for name, mods in dt.stages():
        if len(mods) == 1 and mods[0] != "logitdiff" and (ROOT / "src" / Path(*mods[0].split(".")) / "__init__.py").exists():
            # a package stage's row is its docstring, which also names what it may import
            row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
            assert "mport" in row, row


# ----------------------------------------------------------------------------- README
def test_readme_is_at_most_300_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the manual's place is docs/"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces as '-'."""
    text = re.sub(r"[`*_]|!?\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = github_slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(markdown: str, base: Path) -> list[str]:
    """Relative links and images of ``markdown`` (a file in ``base``) whose file or anchor does not exist."""
    bad = []
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (base / path) if path else None
        if file is not None and not file.exists():
            bad.append(f"{target}: no such file")
            continue
        if anchor:
            doc = markdown if file is None else file.read_text(encoding="utf-8") if file.suffix == ".md" else None
            if doc is None or anchor not in anchors(doc):
                bad.append(f"{target}: no such anchor")
    return bad


def test_link_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Gates for CI: `--fail-on`\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    text = ("# Top\n\n[ok](docs/page.md) [ok](docs/page.md#gates-for-ci---fail-on) [ok](docs/page.md#twice-1) [ok](#top)\n"
            "[bad](docs/nope.md) [bad](docs/page.md#gates) [bad](#nowhere) ![bad](docs/img.png) [web](https://example.org/x)\n"
            "```text\n[in code](not/checked.md)\n```\n")
    assert broken_links(text, tmp_path) == ["docs/nope.md: no such file", "docs/page.md#gates: no such anchor",
                                            "#nowhere: no such anchor", "docs/img.png: no such file"]


def test_readme_links_point_at_files_and_anchors_that_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S))
    assert len(links) >= 20 and any("#" in link for link in links)
    assert broken_links(text, ROOT) == []


def test_docs_name_only_repository_paths_that_exist():
    """A path in a code span (`bench/RESULTS.md`, `src/logitdiff/flips/salient.py`, `logitdiff/store/validate.py`)
    names a file of this checkout: moved modules leave no stale path behind in README or docs/."""
    missing = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`\s]+)`", page.read_text(encoding="utf-8")):
            if not re.fullmatch(r"(?:src|tests|scripts|bench|docs|training|logitdiff|store|flips)/[\w./-]*\w(?:/)?", span):
                continue
            candidates = [ROOT / span, ROOT / "src" / span, ROOT / "src" / "logitdiff" / span]
            if not any(c.exists() for c in candidates):
                missing.append(f"{page.relative_to(ROOT)}: `{span}`")
    assert missing == []


def test_docs_name_only_modules_and_attributes_that_exist():
    """A dotted name in a code span (`logitdiff.report.metric_registry`, `logitdiff.sources.options.OPTIONS`)
    imports: a renamed module or attribute leaves no stale name behind."""
    import importlib

    def resolves(name: str) -> bool:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ImportError:
                continue
            try:
                for attr in parts[k:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                return False
            return True
        return False

    assert resolves("logitdiff.sources.options.OPTIONS") and not resolves("logitdiff.storekinds") and not resolves("logitdiff.api.no_such")
    names = {(page.relative_to(ROOT).as_posix(), name) for page in [README, *sorted((ROOT / "docs").glob("*.md"))]
             for name in re.findall(r"`(logitdiff(?:\.\w+)+)", page.read_text(encoding="utf-8"))}
    assert len(names) >= 20
    assert sorted(f"{page}: `{name}`" for page, name in names if not resolves(name)) == []


def test_python_example_is_the_same_in_readme_and_docs():
    """README's Python example (tests/test_api.py runs it) is the one the docs show."""
    def first_python(text: str) -> str:
        return re.search(r"```python\n(.*?)```", text, re.S).group(1)

    assert first_python(README.read_text(encoding="utf-8")) == first_python((ROOT / "docs" / "python-api.md").read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- README's commands, run as written
# Commands README shows that this test does not run, each with the reason (matched exactly,
# the trailing comment dropped):
EXEMPT = {
    "SKIP_SERVERS=1 bash scripts/setup.sh && .venv/bin/logitdiff run":
        "installs the machine (minutes of builds) and then runs the full default run, which test_builtin_run runs",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q -p no:cacheprovider":
        "CI's own command (.ci/run runs exactly these two steps): the whole test suite, this test included",
    "logitdiff run":
        "the full default run (68 items, eight candidates; ~5 minutes on 2 cores): tests/test_builtin_run.py runs the "
        "same job (`run --out DIR`) and checks its figures",
}
SERVED_PORT = "8080"  # the port README's served example uses; the test's server takes a free one instead


def readme_commands(text: str) -> list[str]:
    """Every command of README's ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                out.append(" ".join(command.split()))
    return out


def test_readme_command_list_and_its_exemptions_hold():
    commands = readme_commands(README.read_text(encoding="utf-8"))
    assert set(EXEMPT) <= set(commands), set(EXEMPT) - set(commands)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh" in ci and ".venv/bin/python -m pytest -q -p no:cacheprovider" in ci
    assert 'main(["run", "--out", str(out)])' in (ROOT / "tests" / "test_builtin_run.py").read_text(encoding="utf-8")
    run = [c for c in commands if c not in EXEMPT]
    # README's own promise: compare your own model in three commands, with hf, gguf and served sources
    assert any(c.startswith("logitdiff capture hf:") and "--workload" in c for c in run)
    assert any(c.startswith("logitdiff capture gguf:") and "--reference" in c for c in run)
    assert any(c.startswith("logitdiff capture served:") and "--reference" in c for c in run)
    assert any(c.startswith("logitdiff compare ") for c in run)


def _workload(path: Path) -> None:
    """Five items of the bundled workload, one of each kind: code, prose, math, a tool call, a copy.
    Tools are written in the key order llama-server re-serialises them in (`type`, then `function`:
    `name`, `description`, `parameters`), as docs/workloads.md tells a user of a served candidate
    to: in another order the server's prompt tokenizes differently from the reference's and the
    item is refused (the bundled workload's tools are in alphabetical order)."""
    import json

    from logitdiff.builtin import WORKLOAD

    keep = ("code-00", "prose-00", "math-00", "tool-00", "copy-00")
    items = {it["id"]: it for it in map(json.loads, WORKLOAD.read_text(encoding="utf-8").splitlines())}
    lines = []
    for iid in keep:
        item = items[iid]
        if "tools" in item:
            item["tools"] = [{"type": tool["type"], "function": {key: tool["function"][key] for key in ("name", "description", "parameters")}}
                             for tool in item["tools"]]
        lines.append(json.dumps(item))
    assert any("tools" in json.loads(line) for line in lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _text(path: Path) -> None:
    """A plain text of several 512-token chunks for README's `text:` example: the bundled
    workload's prompts, one after another, as often as it takes (a real text, no hub)."""
    import json

    from logitdiff.builtin import WORKLOAD

    prompts = []
    for line in WORKLOAD.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        prompts.append(item.get("prompt") or " ".join(str(m.get("content", "")) for m in item.get("messages", [])))
    text = "\n\n".join(p for p in prompts if p)
    path.write_text((text + "\n\n") * max(1, -(-40_000 // max(1, len(text)))), encoding="utf-8")


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    """README's commands, in order, in one fresh directory holding what they name: `./my-model`
    (the bundled model's transformers directory), `./my-model-Q4_K_M.gguf` and
    `./my-model-Q8_0.gguf` (its llama.cpp quantizations), `my.jsonl` (five items of the bundled
    workload) and `wiki.test.raw` (a plain text of several chunks). `logitdiff` is this checkout's
    (`python -m logitdiff.cli`), `llama-server` the one scripts/build_llama_server.sh built;
    the one change made to a command is the served example's port (a free one, not 8080)."""
    from servers import LLAMA_SERVER, Server, ServerFailed, free_port

    from logitdiff.builtin import TINY_DIR, gguf_path

    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir(), bin_dir.mkdir()
    shutil.copytree(TINY_DIR, work / "my-model")
    shutil.copy2(gguf_path("Q4_K_M"), work / "my-model-Q4_K_M.gguf")
    shutil.copy2(gguf_path("Q8_0"), work / "my-model-Q8_0.gguf")
    _workload(work / "my.jsonl")
    _text(work / "wiki.test.raw")
    shim = bin_dir / "logitdiff"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m logitdiff.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    commands = [c for c in readme_commands(README.read_text(encoding="utf-8")) if c not in EXEMPT]
    servers: list[Server] = []
    port = None
    try:
        for command in commands:
            if command.endswith("&"):  # a server README starts in the background
                argv = shlex.split(command[:-1])
                assert argv[0] == "llama-server" and argv[argv.index("--port") + 1] == SERVED_PORT, command
                port = free_port()
                argv[0], argv[argv.index("--port") + 1] = str(LLAMA_SERVER), str(port)
                if not LLAMA_SERVER.exists():
                    pytest.fail(f"{LLAMA_SERVER} not found: run scripts/build_llama_server.sh first", pytrace=False)
                in_work = ["bash", "-c", f"cd {shlex.quote(str(work))} && exec {shlex.join(argv)}"]  # README's relative paths
                try:
                    servers.append(Server("llama-server", in_work, port, tmp_path / "llama-server.log", env=env, ready_path="/health",
                                          ready_timeout=120).start())
                except ServerFailed as e:
                    pytest.fail(str(e), pytrace=False)
                continue
            if port is not None:
                command = command.replace(f"127.0.0.1:{SERVED_PORT}", f"127.0.0.1:{port}")
            r = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"README command failed ({r.returncode}): {command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    finally:
        for server in servers:
            server.stop()
    # what README says they write
    for report in ("reports/q4", "reports/served"):
        assert all((work / report / name).is_file() for name in ("report.json", "tokens.parquet", "report.md", "report.html")), report
    assert (work / "reports" / "q4" / "flips.parquet").is_file() and (work / "reports" / "q4" / "correctness.parquet").is_file()
    assert (work / "my-drift" / "summary.json").is_file() and (work / "my-drift" / "report.html").is_file()
