"""``logitdiff layers``: per-layer hidden states of two engines at the teacher-forced positions.

Every figure is checked against an independent float64 numpy forward pass of the same small
random Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU written out here), so a hook on
the wrong point (e.g. transformers' ``hidden_states[-1]``, which is after the final norm) or
an off-by-one layer in llama.cpp's ``l_out-i`` fails. The candidate is the same model with
one layer's weights changed: every point before it must be bit-identical, and that layer must
be the first beyond the floor and the one that adds the most error.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import make_random_llama  # noqa: E402

import logitdiff.api as api  # noqa: E402
from logitdiff import layers as L  # noqa: E402
from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources.layer_hooks import family_of, layer_hooks  # noqa: E402

N_LAYER = 3
CHANGED = 1  # the candidate's changed decoder layer
PROMPTS = ["def fibonacci(n):\n    a, b = 0, 1\n", "The quick brown fox jumps", "What is 12 + 30? 42. Repeat:"]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model A (float32), model B = A with decoder layer CHANGED's MLP perturbed, and A with
    one layer fewer; all with the same tokenizer."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("layers")
    a = make_random_llama(root / "a", hidden=64, intermediate=128, layers=N_LAYER, heads=4, kv_heads=2, dtype="float32")
    tok_files = [p for p in a.iterdir() if p.name.startswith(("tokenizer", "special", "chat_template"))]

    def variant(name, edit):
        m = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
        with torch.no_grad():
            edit(m)
        d = root / name
        m.save_pretrained(str(d))
        for f in tok_files:
            (d / f.name).write_bytes(f.read_bytes())
        return d

    def perturb(m):
        g = torch.Generator().manual_seed(1)
        w = m.model.layers[CHANGED].mlp.down_proj.weight
        w += 0.03 * torch.randn(w.shape, generator=g)

    def drop_last(m):
        m.model.layers = m.model.layers[:-1]
        m.config.num_hidden_layers = N_LAYER - 1

    return {"a": a, "b": variant("b", perturb), "short": variant("short", drop_last), "root": root}


@pytest.fixture(scope="module")
def teacher(models):
    wl = models["root"] / "w.jsonl"
    wl.write_text("".join(json.dumps({"id": f"i{k}", "prompt": p, "max_tokens": 10}) + "\n" for k, p in enumerate(PROMPTS)))
    out = models["root"] / "ref"
    api.capture_run(f"hf:{models['a']},dtype=float32,threads=1", out, workload=wl)
    from logitdiff.store import RunReader

    return RunReader(out)


@pytest.fixture(scope="module")
def gguf_f32(models):
    pytest.importorskip("llama_cpp")
    from logitdiff.sources.gguf_export import export_gguf

    return export_gguf(models["a"], models["root"] / "a-F32.gguf", "F32")


def _weights(model_dir) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {k: v.double().numpy() for k, v in m.state_dict().items()}, m.config


# ---------------------------------------------------------------- independent numpy forward
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    f = pos[:, None] * inv[None, :]
    emb = np.concatenate([f, f], -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def np_llama(w: dict, cfg, ids) -> tuple[list[np.ndarray], np.ndarray]:
    """float64 forward: [embedding, after layer 0, ..., after layer L-1] ([T, H] each) and
    the logits [T, V] (final norm + lm_head)."""
    T = len(ids)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // nh
    pos = np.arange(T, dtype=np.float64)
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    states = [x]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, d)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        att = np.empty((T, nh, d))
        for hh in range(nh):
            g = hh // (nh // nkv)
            s = q[:, hh] @ k[:, g].T / math.sqrt(d) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
        x = x + att.reshape(T, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        states.append(x)
    logits = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
    return states, logits


def _head64(w, cfg, h):
    return _rms(np.asarray(h, np.float64), w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T


def _kl64(zp, zq):
    lp = zp - np.logaddexp.reduce(zp, -1, keepdims=True)
    lq = zq - np.logaddexp.reduce(zq, -1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def _independent(models, teacher):
    """Per position (all items, in order): numpy rel_l2 / cosine / SQNR per point of B
    against A, the KL of their final logits, and each item's row range."""
    wa, cfg = _weights(models["a"])
    wb, _ = _weights(models["b"])
    rel, cos, sqnr, add, kl, ranges = [], [], [], [], [], []
    for it in teacher.items():
        seq = list(it.prompt_ids) + list(it.teacher_ids)[:-1]
        sel = len(it.prompt_ids) - 1 + np.asarray(it.positions)
        sa, za = np_llama(wa, cfg, seq)
        sb, zb = np_llama(wb, cfg, seq)
        r = np.stack([x[sel] for x in sa])  # [points, n, H]
        c = np.stack([x[sel] for x in sb])
        rr, cc, dd = (r * r).sum(-1), (c * c).sum(-1), ((c - r) ** 2).sum(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel.append((np.sqrt(dd / rr)).T)
            cos.append(np.where(dd == 0, 1.0, (r * c).sum(-1) / np.sqrt(rr * cc)).T)
            sqnr.append((10 * np.log10(rr / dd)).T)
            e = c - r
            de = np.concatenate([e[:1], e[1:] - e[:-1]])
            add.append(np.sqrt((de * de).sum(-1) / rr).T)
        start = sum(len(k) for k in kl)
        kl.append(_kl64(za[sel], zb[sel]))
        ranges.append((start, start + len(sel)))
    return np.concatenate(rel), np.concatenate(cos), np.concatenate(sqnr), np.concatenate(add), np.concatenate(kl), ranges


# ---------------------------------------------------------------------------- pure numerics
def test_layer_errors_against_float64_formulas():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(7, 33)).astype(np.float32)
    c = (r + 1e-3 * rng.normal(size=r.shape)).astype(np.float32)
    c[2] = r[2]  # identical row
    c[3] = -r[3]  # opposite row
    e = L.layer_errors(r, c)
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    for i in range(len(r)):
        d = np.linalg.norm(c64[i] - r64[i])
        assert e["rel_l2"][i] == pytest.approx(d / np.linalg.norm(r64[i]), rel=1e-12, abs=0)
        assert e["cosine"][i] == pytest.approx(r64[i] @ c64[i] / np.linalg.norm(r64[i]) / np.linalg.norm(c64[i]), rel=1e-12)
        want = math.inf if d == 0 else 20 * math.log10(np.linalg.norm(r64[i]) / d)
        assert e["sqnr_db"][i] == pytest.approx(want, rel=1e-12)
    assert e["rel_l2"][2] == 0 and e["cosine"][2] == 1 and e["sqnr_db"][2] == math.inf
    assert e["rel_l2"][3] == pytest.approx(2.0) and e["cosine"][3] == pytest.approx(-1.0)
    # bf16-like and float64 inputs give the same float64 figures as their float64 values
    assert np.array_equal(L.layer_errors(r.astype(np.float64), c.astype(np.float64))["rel_l2"], e["rel_l2"])
    with pytest.raises(ValueError):
        L.layer_errors(r, c[:, :-1])


def test_growth_first_beyond_and_top_layers():
    g = L.growth([0.0, 0.0, 0.5, 1.0, 1.5])
    assert g[0] is None and math.isnan(g[1]) and g[2] == math.inf and g[3] == 2.0 and g[4] == 1.5
    assert L.top_added([0.0, math.nan, 0.3, 0.1, 0.2], 2) == [2, 4]
    assert L.first_beyond([1e-7, 2e-7, 1e-3], [1e-6, 1e-6, 1e-6]) == 2
    assert L.first_beyond([1e-7, 2e-7], [1e-6, 1e-6]) is None
    assert L.first_beyond([1.0], None) is None


def test_added_error_is_the_change_of_the_error_vector():
    rng = np.random.default_rng(1)
    r0, r1 = rng.normal(size=(2, 5, 16))
    e0 = 1e-2 * rng.normal(size=r0.shape)
    c0, c1 = r0 + e0, r1 + e0  # a layer that passes its input error through unchanged adds nothing
    assert np.allclose(L.added_error(r1, c1, r0, c0), 0, atol=1e-15)
    assert np.allclose(L.added_error(r0, c0), np.linalg.norm(e0, axis=1) / np.linalg.norm(r0, axis=1), rtol=1e-13)
    c1 = r1 + 3 * e0  # it tripled the error: adds 2 e0
    assert np.allclose(L.added_error(r1, c1, r0, c0), 2 * np.linalg.norm(e0, axis=1) / np.linalg.norm(r1, axis=1), rtol=1e-12)


def test_spearman_against_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n in (3, 10, 57):
        x = rng.integers(0, 5, n).astype(float)  # many ties
        y = x + rng.normal(size=n)
        assert L.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert math.isnan(L.spearman([1, 2], [3, 4])) and math.isnan(L.spearman([1, 1, 1], [1, 2, 3]))


def test_window_tokens_bounds_memory():
    # two sides x (33 points x 4096 + V) float32 per row within the chunk: H = 4,096, 32 layers
    w = L.window_tokens(256 << 20, 33, 4096, 248_320)
    assert 2 * 4 * w * (33 * 4096 + 248_320) <= 256 << 20 and w >= 64
    assert L.window_tokens(1, 33, 4096, 1000) == 1


# --------------------------------------------------------------------- engines vs numpy
def test_hf_points_are_the_residual_stream_and_the_last_reproduces_the_logits(models, teacher):
    from logitdiff.sources import applied_threads, open_source

    w, cfg = _weights(models["a"])
    it = teacher.items()[0]
    seq = list(it.prompt_ids) + list(it.teacher_ids)[:-1]
    sel = len(it.prompt_ids) - 1 + np.asarray(it.positions)
    states, z64 = np_llama(w, cfg, seq)
    with open_source(f"hf:{models['a']},dtype=float32,threads=1") as src, applied_threads([src]):
        eng = layer_hooks(src, window=7)
        assert eng.engine == "hf"
        eng.begin()
        hid, logits = [], []
        for a in range(0, len(seq), 7):  # windows of 7 tokens over the KV cache
            s = sel[(sel >= a) & (sel < a + 7)] - a
            h, z = eng.window(seq[a:a + 7], a, s)
            hid.append(h)
            logits.append(z)
        hid, logits = np.concatenate(hid, 1), np.concatenate(logits)
        plain = src.score(it.prompt_ids, it.teacher_ids)[np.asarray(it.positions)]
    assert hid.shape == (1 + N_LAYER, len(sel), cfg.hidden_size)
    for j, s in enumerate(states):
        err = np.linalg.norm(hid[j] - s[sel], axis=-1) / np.linalg.norm(s[sel], axis=-1)
        assert err.max() < 1e-5, (j, err.max())
    # the last point is before the final norm: through norm + lm_head it gives the logits
    assert np.abs(_head64(w, cfg, hid[-1]) - logits).max() < 1e-4
    assert np.abs(logits - z64[sel]).max() < 1e-4
    assert np.abs(logits - plain).max() < 1e-4


def test_gguf_points_are_l_out_and_the_last_reproduces_the_logits(models, teacher, gguf_f32):
    from logitdiff.sources import open_source

    w, cfg = _weights(models["a"])
    it = teacher.items()[1]
    seq = list(it.prompt_ids) + list(it.teacher_ids)[:-1]
    sel = len(it.prompt_ids) - 1 + np.asarray(it.positions)
    states, _ = np_llama(w, cfg, seq)
    with open_source(f"gguf:{gguf_f32},threads=1,n_ctx=256") as src:
        plain = src.score(it.prompt_ids, it.teacher_ids)[np.asarray(it.positions)]
        for window, split in ((len(seq), False), (5, False), (len(seq), True)):
            eng = layer_hooks(src, window=window, split=split)
            assert eng.engine == "gguf"
            try:
                eng.begin()
                hid, logits = [], []
                for a in range(0, len(seq), window):
                    s = sel[(sel >= a) & (sel < a + window)] - a
                    h, z = eng.window(seq[a:a + window], a, s)
                    hid.append(h)
                    logits.append(z)
            finally:
                eng.close()
            hid, logits = np.concatenate(hid, 1), np.concatenate(logits)
            # llama.cpp keeps K and V in float16 (its default KV cache): ~1e-4 relative, where a
            # wrong layer (off by one, or after the final norm) is an O(1) error
            for j, s in enumerate(states):
                err = np.linalg.norm(hid[j] - s[sel], axis=-1) / np.linalg.norm(s[sel], axis=-1)
                assert err.max() < (1e-6 if j == 0 else 3e-3), (window, split, j, err.max())
            assert np.abs(_head64(w, cfg, hid[-1]) - logits).max() < 1e-4
            assert np.abs(logits - plain).max() < 1e-4


# ----------------------------------------------------------------------------- the job
def test_figures_against_independent_numpy(models, teacher, tmp_path):
    from logitdiff.sources import applied_threads, open_source

    rel, cos, sqnr, add, kl, ranges = _independent(models, teacher)
    points = 1 + N_LAYER
    with open_source(f"hf:{models['a']},dtype=float32,threads=1") as ra, open_source(f"hf:{models['b']},dtype=float32,threads=1") as rb, \
            applied_threads([ra]):
        # a chunk of 6 tokens per forward pass: every sequence goes through several windows
        doc = L.layer_attribution(ra, [rb], teacher, chunk_bytes=2 * 4 * 6 * (points * 64 + ra.vocab_size))
    assert doc["geometry"]["window_tokens"] == 6
    assert doc["geometry"]["points"] == ["embedding"] + [f"layer {i}" for i in range(N_LAYER)]
    c = doc["candidates"][0]
    p = c["per_point"]
    for j in range(points):
        for key, arr, q in (("rel_l2_median", rel, 50), ("rel_l2_p95", rel, 95), ("cosine_median", cos, 50), ("cosine_p5", cos, 5),
                            ("added_rel_l2_median", add, 50)):
            want = np.percentile(arr[:, j], q)
            assert p[key][j] == pytest.approx(want, rel=2e-3, abs=1e-9), (key, j)
        if np.all(sqnr[:, j] == math.inf):  # identical everywhere (numpy's percentile gives inf - inf = nan)
            assert p["sqnr_db_median"][j] == math.inf
        else:
            assert p["sqnr_db_median"][j] == pytest.approx(np.percentile(sqnr[:, j], 50), rel=1e-3)
    # the points before the changed layer are bit-identical; the changed layer is where it starts
    changed = 1 + CHANGED
    assert all(p["rel_l2_median"][j] == 0 and p["rel_l2_p95"][j] == 0 for j in range(changed))
    assert p["rel_l2_median"][changed] > 1e-3
    assert c["first_beyond_floor"] == changed
    assert c["top_added"][0] == changed and p["growth"][changed] == math.inf
    assert p["growth"][changed + 1] == pytest.approx(np.median(rel[:, changed + 1]) / np.median(rel[:, changed]), rel=2e-3)
    assert c["kl_mean_nats"] == pytest.approx(kl.mean(), rel=2e-3)
    # per item, the rank correlation of each point's error with the final KL
    stats = pytest.importorskip("scipy.stats")
    for item, (a, b) in zip(c["items"], ranges):
        assert item["n"] == b - a and item["kl_mean_nats"] == pytest.approx(kl[a:b].mean(), rel=2e-3)
        for j in range(changed, points):
            assert item["spearman_rel_l2_kl"][j] == pytest.approx(stats.spearmanr(rel[a:b, j], kl[a:b]).statistic, abs=0.15)
        assert all(math.isnan(item["spearman_rel_l2_kl"][j]) for j in range(changed))  # constant 0 error
    # the floor: the reference with each window in two forward passes; its band is float noise
    f = doc["floor"]
    assert f["engine"] == "hf" and max(f["per_point"]["rel_l2_p95"]) < 1e-5


def test_hf_against_gguf_f32_is_float_noise_at_every_layer(models, teacher, gguf_f32, tmp_path):
    doc = api.layers(f"hf:{models['a']},dtype=float32,threads=1", [f"gguf:{gguf_f32},threads=1,n_ctx=256"], teacher.path, tmp_path / "rep",
                     floor="none")
    c = doc["candidates"][0]
    assert c["engine"] == "gguf" and doc["floor"] is None and c["first_beyond_floor"] is None
    # llama.cpp's float16 KV cache: ~5e-4; an off-by-one layer or a post-norm point would be O(1)
    assert c["per_point"]["rel_l2_p95"][0] < 1e-6 and max(c["per_point"]["rel_l2_p95"]) < 3e-3 and c["kl_mean_nats"] < 1e-5
    out = tmp_path / "rep"
    from logitdiff.contracts import load_layers

    assert load_layers(out)["candidates"][0]["spec"] == c["spec"]
    html = (out / "layers.html").read_text()
    assert "Plotly.newPlot" in html and "<script src" not in html and "http://" not in html.split("<script id=\"plotly-js\">")[0]
    md = (out / "layers.md").read_text()
    assert "no floor was measured" in md and "layer 2" in md


# ------------------------------------------------------------------------ one-line errors
def test_layer_count_mismatch_is_one_line(models, teacher, tmp_path):
    with pytest.raises(LogitdiffError, match=r"2 layers, the reference .* has 3") as e:
        api.layers(f"hf:{models['a']},dtype=float32,threads=1", [f"hf:{models['short']},dtype=float32,threads=1"], teacher.path, tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


def test_sequence_beyond_the_context_is_one_line(models, teacher, gguf_f32, tmp_path):
    with pytest.raises(LogitdiffError, match=r"exceeds n_ctx=16 \(raise it") as e:
        api.layers(f"hf:{models['a']},dtype=float32,threads=1", [f"gguf:{gguf_f32},threads=1,n_ctx=16"], teacher.path, tmp_path / "x",
                   floor="none")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


def test_served_source_is_refused_before_anything_opens(teacher, tmp_path):
    with pytest.raises(LogitdiffError, match="served source hands out top-K") as e:
        api.layers("hf:/nonexistent", ["openai:http://127.0.0.1:9/v1"], teacher.path, tmp_path / "x")
    assert "\n" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "logitdiff.cli", "layers", "builtin:tiny", "served:http://127.0.0.1:9/v1",
                        "--reference", str(teacher.path), "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "served source" in r.stderr and not (tmp_path / "y").exists()


def test_layers_takes_the_old_flag_and_keyword_with_one_notice(models, teacher, tmp_path, capsys):
    """`layers ... --teacher RUN` and ``api.layers(..., teacher=RUN)`` (the old names of
    --reference / reference_run=) give the same layers.json as the new names, each with exactly
    one notice: a stderr line from the CLI, a DeprecationWarning at the caller's line from the API."""
    import warnings

    from logitdiff.cli import main

    argv = ["layers", f"hf:{models['a']},dtype=float32,threads=1", f"hf:{models['b']},dtype=float32,threads=1", "--floor", "none"]
    assert main(argv + ["--reference", str(teacher.path), "--out", str(tmp_path / "new")]) == 0
    assert "deprecated" not in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv + ["--teacher", str(teacher.path), "--out", str(tmp_path / "old")]) == 0
        assert not [w for w in caught if "teacher" in str(w.message)]
        doc = api.layers(argv[1], [argv[2]], teacher=teacher.path, floor="none")
    notes = [w for w in caught if issubclass(w.category, DeprecationWarning) and "teacher" in str(w.message)]
    assert [str(w.message) for w in notes] == ["layers: teacher= is deprecated, use reference_run= (accepted until 0.3)"]
    assert notes[0].filename == __file__
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "deprecated" in line] == [
        "logitdiff: --teacher is deprecated, use --reference (accepted until 0.3)"]
    new, old = (json.loads((tmp_path / d / "layers.json").read_text()) for d in ("new", "old"))
    from logitdiff.contracts import layers_json

    assert old["candidates"] == new["candidates"] == json.loads(layers_json(doc))["candidates"]
    assert old["teacher"] == new["teacher"] == str(teacher.path)
    for extra, line in ((["--teacher", str(teacher.path), "--reference", str(teacher.path)], "--teacher and --reference both given"),
                        ([], "--reference RUN is required: the reference RUN whose tokens are teacher-forced")):
        assert main(argv + extra + ["--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"logitdiff: error: {line}") and err.count("\n") == 1 and not (tmp_path / "x").exists()


def test_bad_floor_and_unknown_architecture(teacher):
    with pytest.raises(LogitdiffError, match="--floor 'bf16'"):
        api.layers("hf:/x", ["hf:/y"], teacher.path, floor="bf16")
    with pytest.raises(LogitdiffError, match="architecture 'mamba' has no per-layer mapping"):
        family_of("hf", "mamba", "hf:/m")


def test_layers_schema_and_typed_dict_agree():
    import typing

    from logitdiff import contracts as C

    s = C.schema("layers")
    assert set(s["properties"]) == set(typing.get_type_hints(C.LayersDoc))
    assert set(s["$defs"]["comparison"]["properties"]) == set(typing.get_type_hints(C.LayersComparison))
    assert set(s["$defs"]["per_point"]["properties"]) == set(typing.get_type_hints(C.LayersPerPoint))
    assert set(s["$defs"]["item"]["properties"]) == set(typing.get_type_hints(C.LayersItem))
    assert set(s["properties"]["geometry"]["properties"]) == set(typing.get_type_hints(C.LayersGeometry))
    assert set(s["properties"]["method"]["properties"]) == set(typing.get_type_hints(C.LayersMethod))


def test_layers_reaches_the_engines_through_the_layer_hooks_only():
    """Stage layers holds the attribution, no engine code: from sources it imports the layer
    hooks' public interface (and parse_spec, to refuse a served spec), nothing of an engine
    module (gguf, hf) and no private name."""
    import ast

    import logitdiff.layers as layers_pkg

    tree = ast.parse(Path(layers_pkg.__file__).read_text(encoding="utf-8"))
    from_sources = sorted({(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                           and (n.module or "").startswith("sources") for a in n.names})
    assert {m for m, _ in from_sources} <= {"sources", "sources.layer_hooks"}, from_sources
    assert not [a for _, a in from_sources if a.startswith("_")], from_sources
    assert ("sources.layer_hooks", "layer_hooks") in from_sources
