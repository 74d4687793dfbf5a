"""Hostile models, round three (issue 39): weights that do not cover their config, GGUF headers
that claim what the file does not hold, chat templates that do not end, names that break a
page's scripts, gate clauses that cost quadratic time.

Real parts only: tiny random Llamas saved by transformers and edited the way a broken upload
is (a tensor left out, a config's layer count changed), GGUFs written by the gguf package with
a field changed or a tensor dropped (``_models.rewrite_gguf``), llama.cpp and transformers
loading them, the CLI in a child process where a missing check would abort the process.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from _models import make_random_llama, rewrite_gguf  # noqa: E402

from logitdiff import api  # noqa: E402
from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources import chat_template, open_source  # noqa: E402
from logitdiff.workload import Item  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
N_LAYER = 2
CHAT = Item(id="chat", messages=[{"role": "user", "content": "What is 12 + 30?"}])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_random_llama(tmp_path_factory.mktemp("hostile_models") / "base", hidden=64, intermediate=128,
                             layers=N_LAYER, heads=2, kv_heads=1, dtype="float32")


@pytest.fixture(scope="module")
def f32(base) -> Path:
    pytest.importorskip("llama_cpp")
    from logitdiff.sources.gguf_export import export_gguf

    return export_gguf(base, base.parent / "base-F32.gguf", "F32")


def _variant(base: Path, name: str, *, config: dict | None = None, weights=None) -> Path:
    """A copy of ``base`` with config fields replaced and its weights passed through ``weights``
    (a function of the state dict)."""
    from safetensors.torch import load_file, save_file

    d = base.parent / name
    shutil.copytree(base, d, dirs_exist_ok=True)
    if config:
        cfg = json.loads((base / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        save_file(weights(load_file(base / "model.safetensors")), d / "model.safetensors", metadata={"format": "pt"})
    return d


def _without(*names):
    return lambda sd: {k: v for k, v in sd.items() if k not in names}


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    code = "import sys; from logitdiff.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode not in (0, -6, 134), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip().startswith(("error", "logitdiff"))]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# --------------------------------------------------------- hf: weights that do not cover the config
def _lm_head_missing(base):
    return _variant(base, "no_head", weights=_without("lm_head.weight")), ["lm_head.weight"], "lack"


def _more_layers(base):
    layer = [f"model.layers.{N_LAYER}.{p}" for p in ("input_layernorm.weight", "mlp.down_proj.weight")]
    return _variant(base, "more_layers", config={"num_hidden_layers": N_LAYER + 1}), layer, "lack"


def _fewer_layers(base):
    layer = [f"model.layers.{N_LAYER - 1}.{p}" for p in ("input_layernorm.weight", "mlp.down_proj.weight")]
    return _variant(base, "fewer_layers", config={"num_hidden_layers": N_LAYER - 1}), layer, "hold tensors the config has no place for"


def _one_attention_weight_missing(base):
    return _variant(base, "no_q", weights=_without("model.layers.1.self_attn.q_proj.weight")), \
        ["model.layers.1.self_attn.q_proj.weight"], "lack"


def _other_shape(base):
    def reshape(sd):
        w = sd["model.layers.0.mlp.up_proj.weight"]
        return {**sd, "model.layers.0.mlp.up_proj.weight": torch.zeros(w.shape[0] + 8, w.shape[1], dtype=w.dtype)}

    return _variant(base, "other_shape", weights=reshape), ["model.layers.0.mlp.up_proj.weight"], "another shape"


@pytest.mark.parametrize("case", [_lm_head_missing, _more_layers, _fewer_layers, _one_attention_weight_missing, _other_shape])
def test_hf_refuses_weights_that_do_not_cover_the_config(base, case, tmp_path):
    model, named, verb = case(base)
    with pytest.raises(LogitdiffError) as e:
        open_source(f"hf:{model}")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{model}: the weights do not cover the config") and verb in msg, msg
    for n in named:
        assert n in msg, msg
    if len(named) > 1:  # a whole layer: a few names, then how many more
        assert re.search(r"and \d+ more$", msg), msg
    # before any capture: nothing is written
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 2}) + "\n")
    with pytest.raises(LogitdiffError, match="do not cover the config"):
        api.capture_run(f"hf:{model}", tmp_path / "run", workload=wl)
    assert not (tmp_path / "run").exists()


def test_hf_capture_of_a_headless_model_exits_non_zero_without_a_run(base, tmp_path):
    """What the campaign saw: capture said "wrote RUN" over a random lm_head."""
    model, _, _ = _lm_head_missing(base)
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 2}) + "\n")
    line = _one_line(_cli("capture", f"hf:{model}", "--workload", str(wl), "--out", str(tmp_path / "run")))
    assert "lm_head.weight" in line and "wrote" not in line
    assert not (tmp_path / "run").exists()


def test_hf_tied_head_without_lm_head_is_the_embedding(base):
    """tie_word_embeddings: the head is the embedding matrix, so no lm_head tensor is right."""
    model = _variant(base, "tied", config={"tie_word_embeddings": True}, weights=_without("lm_head.weight"))
    with open_source(f"hf:{model},dtype=float32") as s:
        emb = s.model.get_input_embeddings().weight
        assert torch.equal(s.lm_head.weight, emb)
        from safetensors.torch import load_file

        assert torch.equal(emb, load_file(model / "model.safetensors")["model.embed_tokens.weight"])


def test_hf_gguf_missing_tensor_is_refused_and_tied_gguf_loads(f32, tmp_path):
    no_q = rewrite_gguf(f32, tmp_path / "no_q.gguf", keep_tensor=lambda n: n != "blk.1.attn_q.weight")
    with pytest.raises(LogitdiffError, match=r"no_q.gguf: the weights do not cover the config: they lack .*layers\.1\.self_attn\.q_proj"):
        open_source(f"hf:{no_q}")
    # a GGUF without output.weight ties its head to the embedding: legitimate, in both engines
    tied = rewrite_gguf(f32, tmp_path / "tied.gguf", keep_tensor=lambda n: n != "output.weight")
    with open_source(f"hf:{tied},dtype=float32") as s:
        assert torch.equal(s.lm_head.weight, s.model.get_input_embeddings().weight)
    with open_source(f"gguf:{tied}") as g:
        assert g.vocab_size == s.vocab_size


# ------------------------------------------------------------- GGUF headers the file does not hold
def _gguf_cases(f32: Path, d: Path):
    import gguf

    tokens = gguf.GGUFReader(str(f32)).fields["tokenizer.ggml.tokens"].contents()
    return [
        ("block_count 0", {"fields": {"llama.block_count": 0}}, "llama.block_count = 0 is outside 1..512"),
        ("block_count 1000", {"fields": {"llama.block_count": 1000}}, "llama.block_count = 1000 is outside 1..512"),
        ("block_count 513", {"fields": {"llama.block_count": 513}}, "llama.block_count = 513 is outside 1..512"),
        ("block_count 5 over 2", {"fields": {"llama.block_count": 5}}, "llama.block_count = 5 but the file holds no tensors of layer blk.2, blk.3, blk.4"),
        ("block_count 1 over 2", {"fields": {"llama.block_count": 1}}, "llama.block_count = 1 but the file holds tensors of layer blk.1 beyond it"),
        ("a layer dropped", {"keep_tensor": lambda n: not n.startswith("blk.0.")}, "no tensors of layer blk.0"),
        ("embedding_length", {"fields": {"llama.embedding_length": 96}}, "token_embd.weight has shape [64, "),
        ("tokens cut", {"fields": {"tokenizer.ggml.tokens": tokens[:-7], "tokenizer.ggml.token_type": [1] * (len(tokens) - 7)}},
         f"rows but tokenizer.ggml.tokens holds {len(tokens) - 7} tokens"),
        ("no embedding", {"keep_tensor": lambda n: n != "token_embd.weight"}, "no token_embd.weight"),
    ]


def test_gguf_claims_are_checked_before_llama_cpp_and_transformers(f32, tmp_path):
    from logitdiff.sources.gguf import GGUFSource

    for k, (name, edit, want) in enumerate(_gguf_cases(f32, tmp_path)):
        path = rewrite_gguf(f32, tmp_path / f"case{k}.gguf", **edit)
        for open_it in (lambda: GGUFSource(path), lambda: GGUFSource(path, tokenizer_only=True),
                        lambda: open_source(f"hf:{path}")):
            with pytest.raises(LogitdiffError) as e:
                open_it()
            msg = str(e.value)
            assert msg.startswith(f"{path}: ") and want in msg and "\n" not in msg, (name, msg)


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_gguf_claiming_1000_layers_is_one_line_not_an_abort(f32, tmp_path, kind):
    """llama.cpp aborted (SIGABRT, no message); transformers built 1000 layers."""
    path = rewrite_gguf(f32, tmp_path / "thousand.gguf", fields={"llama.block_count": 1000})
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "hello", "max_tokens": 2}) + "\n")
    line = _one_line(_cli("capture", f"{kind}:{path}", "--workload", str(wl), "--out", str(tmp_path / "run")))
    assert f"{path}: llama.block_count = 1000" in line
    assert not (tmp_path / "run").exists()


def test_gguf_metadata_is_read_once(f32, monkeypatch):
    """The layout check reuses the header read the source makes (a 262,144-token header takes
    seconds through GGUFReader): gguf: reads it with the fast parser (sources/gguf_meta.py,
    cached per file version) and builds no GGUFReader; hf:FILE.gguf builds one per open."""
    import gguf

    made = []
    real = gguf.GGUFReader

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, *a, **k):
            if sys._getframe(1).f_globals["__name__"].startswith("logitdiff."):  # ours, not transformers'
                made.append(a[0])
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    with open_source(f"gguf:{f32}"):
        pass
    assert made == []
    made.clear()
    with open_source(f"hf:{f32}") as s:
        assert s.identity()["gguf_file_type"] == "ALL_F32"
    assert made == [str(f32)]  # the check and identity() from one read


# ------------------------------------------------------------------------ chat templates
HANGS = {
    "nested loops over range": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}x",
    "nested loops over a string, no call": "{% set s = 'x' * 9999 %}{% for a in s %}{% for b in s %}{% for c in s %}"
                                           "{% endfor %}{% endfor %}{% endfor %}x",
    "exponential macro recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
}
FLOOD = "{% for a in range(99999) %}{% for b in range(99999) %}{{ 'yyyyyyyyyy' }}{% endfor %}{% endfor %}"


def _with_template(base: Path, f32: Path, name: str, template: str) -> tuple[str, str]:
    d = base.parent / f"tpl_{name.replace(' ', '_').replace(',', '')}"
    shutil.copytree(base, d, dirs_exist_ok=True)
    (d / "chat_template.jinja").write_text(template)
    g = rewrite_gguf(f32, base.parent / f"{d.name}.gguf", fields={"tokenizer.chat_template": template})
    return f"hf:{d}", f"gguf:{g}"


@pytest.mark.parametrize("name", sorted(HANGS))
def test_a_template_that_does_not_end_is_stopped_at_the_bound(base, f32, name, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)
    before = sys.gettrace()
    for spec in _with_template(base, f32, name, HANGS[name]):
        with open_source(spec) as s:
            t0 = time.monotonic()
            with pytest.raises(LogitdiffError) as e:
                s.render(CHAT)
            took = time.monotonic() - t0
        assert str(e.value) == f"item 'chat': {spec}: chat template ran past the 1 s bound", str(e.value)
        assert 1.0 <= took < 4.0, took
        assert sys.gettrace() is before  # the thread's trace function is put back


def test_a_template_that_floods_is_stopped_at_the_output_bound(base, f32, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_MAX_CHARS", 100_000)
    for spec in _with_template(base, f32, "flood", FLOOD):
        with open_source(spec) as s:
            t0 = time.monotonic()
            with pytest.raises(LogitdiffError) as e:
                s.render(CHAT)
            assert time.monotonic() - t0 < 5
        assert str(e.value) == f"item 'chat': {spec}: chat template rendered more than the 100,000 characters bound"


def test_bounded_render_is_the_template_text(base, f32):
    """The bound changes no prompt: the ids are those of transformers' own render."""
    with open_source(f"hf:{base}") as s, open_source(f"gguf:{f32}") as g:
        text = s.tok.apply_chat_template(CHAT.messages, add_generation_prompt=True, tokenize=False)
        assert s.render(CHAT) == s.tok(text, add_special_tokens=False)["input_ids"]
        assert g.render_text(CHAT) == text and g.render(CHAT) == s.render(CHAT)


def test_bound_under_a_debugger_keeps_its_trace_function():
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        assert chat_template.render_bounded(lambda: "ok", "x") == "ok"
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


# ------------------------------------------------------------------ a name that breaks the page
HOSTILE_NAME = "<!--<script>a&b"


def test_layers_page_draws_with_a_hostile_model_name(base, f32, tmp_path):
    pytest.importorskip("plotly")
    named = rewrite_gguf(f32, tmp_path / f"{HOSTILE_NAME}.gguf", fields={"general.name": HOSTILE_NAME})
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "The quick brown fox", "max_tokens": 4}) + "\n")
    api.capture_run(f"hf:{base},dtype=float32,threads=1", tmp_path / "ref", workload=wl)
    api.layers(f"hf:{base},dtype=float32,threads=1", [f"gguf:{named},threads=1,n_ctx=64"], tmp_path / "ref", tmp_path / "rep")
    page = (tmp_path / "rep" / "layers.html").read_text()
    scripts = re.findall(r"<script(?: [^>]*)?>(.*?)</script>", page, flags=re.S)
    plots = scripts[-1]
    # the tokenizer leaves script data only at the element's own end tag: nothing in it may open
    # an HTML comment or a script (the double-escaped state)
    for bad in ("<!--", "<script", "</script", "</"):
        assert bad not in plots.lower(), bad
    calls = []  # (id, data, layout) of each Plotly.newPlot(ID, DATA, LAYOUT, {responsive: true});
    dec = json.JSONDecoder()
    for m in re.finditer(r"Plotly\.newPlot\(", plots):
        args, at = [], m.end()
        for _ in range(3):
            value, at = dec.raw_decode(plots, at)
            args.append(value)
            assert plots[at:at + 2] == ", "
            at += 2
        assert plots.startswith("{responsive: true});", at)
        calls.append(args)
    assert [c[0] for c in calls] == ["err", "added", "corr"]
    names = [t.get("name", "") for _, data, _ in calls for t in data]
    assert any(HOSTILE_NAME in n for n in names), names  # the name reads back exactly
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:  # a real browser: the plots are drawn
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              (tmp_path / "rep" / "layers.html").as_uri()], capture_output=True, text=True, timeout=120).stdout
        assert dom.count('class="main-svg"') >= 3, dom[-2000:]


# ------------------------------------------------------------------------------ gate clauses
@pytest.mark.parametrize("clause", [
    "kl_mean>0" + " " * 1_000_000 + "1",
    "kl_mean" + " " * 1_000_000 + "x",
    "kl_mean" + " " * 1_000_000 + ">",
    "k" * 1_000_000 + ">1",
    "kl_mean>" + "1" * 500_000 + " " * 500_000 + "x",
    "kl_mean" + "\t " * 500_000 + ">" + "=" * 10,
])
def test_a_megabyte_clause_is_refused_fast(clause):
    from logitdiff.report.gates import parse_gates

    t0 = time.monotonic()
    with pytest.raises(LogitdiffError) as e:
        parse_gates(clause)
    assert time.monotonic() - t0 < 1.0
    msg = str(e.value)
    assert len(msg) < 1000 and f"({len(clause)} characters)" in msg, msg[:300]


def test_a_space_padded_valid_clause_is_read():
    from logitdiff.report.gates import parse_gates

    t0 = time.monotonic()
    (g,) = parse_gates(" " * 1_000_000 + "kl_mean" + " " * 1_000_000 + ">=" + " " * 1_000_000 + "0.25" + " " * 1_000_000)
    assert time.monotonic() - t0 < 1.0
    assert (g.metric, g.op, g.threshold, g.text) == ("kl_mean", ">=", 0.25, "kl_mean>=0.25")
    assert math.isfinite(g.threshold)


def test_a_template_that_recurses_without_end_is_one_line(base, f32):
    template = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    for spec in _with_template(base, f32, "recursion", template):
        with open_source(spec) as s, pytest.raises(LogitdiffError) as e:
            s.render(CHAT)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("item 'chat': chat template of ") and "RecursionError" in msg, msg
