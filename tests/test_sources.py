"""The source contract: declared row kinds, the registry, and no process-wide state
changed by opening a source (real models: the bundled tiny one, its GGUF ladder)."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
llama_cpp = pytest.importorskip("llama_cpp")

from logitdiff.builtin import TINY_DIR  # noqa: E402
from logitdiff.errors import LogitdiffError  # noqa: E402
from logitdiff.sources.quantize import build_ladder, current_llama_log  # noqa: E402
from logitdiff.sources import FullLogitSource, RowKind, TopKRows, TopKSource, kinds, open_source, register, requested_threads
from logitdiff.sources.registry import _FACTORIES  # noqa: E402


def _process_state() -> tuple:
    """What opening a source must leave as it was: torch's intra-op threads, llama.cpp's
    log callback (function pointer and user data), the llama-cpp-python logger's level, and
    the binding function ``load_llama`` swaps for the duration of a load."""
    import llama_cpp.llama_cpp as C

    cb, ud = current_llama_log(llama_cpp)
    return (torch.get_num_threads(), ctypes.cast(cb, ctypes.c_void_p).value, ud.value,
            logging.getLogger("llama-cpp-python").level, C.llama_model_default_params)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    return build_ladder(TINY_DIR, tmp_path_factory.mktemp("cache"), ["Q8_0"])


@pytest.fixture
def other_threads():
    """A torch thread count no spec below asks for, restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


def test_building_a_quant_leaves_the_llama_log_callback(tmp_path):
    before = _process_state()
    build_ladder(TINY_DIR, tmp_path, ["Q8_0"])  # quantize routes llama.cpp's log while it runs
    assert _process_state() == before


@pytest.mark.parametrize("spec,threads", [
    ("builtin:tiny", 1),  # the bundled model asks for one thread...
    ("builtin:tiny,threads=2", 2),
    ("hf:{tiny},threads=5", 5),
    ("hf:{tiny}", None),
    ("builtin:tiny-F32", None),  # ...which llama.cpp takes per context: nothing to apply
    ("gguf:{q8},threads=2", None),
])
def test_opening_a_source_changes_no_process_state(spec, threads, ladder, other_threads, monkeypatch, tmp_path):
    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    before = _process_state()
    with open_source(spec.format(tiny=TINY_DIR, q8=ladder["Q8_0"])) as src:
        assert _process_state() == before
        assert torch.get_num_threads() == other_threads
        assert src.threads == threads and requested_threads([src]) == threads
        assert isinstance(src, FullLogitSource) and src.row_kind is RowKind.FULL
        rows = src.score([1, 2, 3], [4, 5])
        assert rows.shape == (2, src.vocab_size) and np.isfinite(rows).all()
        assert _process_state() == before
    assert _process_state() == before


def test_requested_threads_takes_the_smallest_request():
    class Asked(FullLogitSource):
        def __init__(self, threads):
            self.threads = threads

    assert requested_threads([Asked(None), Asked(4), Asked(2)]) == 2
    assert requested_threads([Asked(None)]) is None


def test_importing_sources_imports_no_backend():
    code = ("import sys, logitdiff.sources, logitdiff.builtin; "
            "print(sorted(m for m in sys.modules if m.startswith('logitdiff.') and m.split('.')[-1] in "
            "('hf', 'gguf', 'served', 'torch', 'llama_cpp', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_kind_lists_the_registered_ones():
    with pytest.raises(LogitdiffError) as ei:
        open_source("nope:x")
    msg = str(ei.value)
    assert "\n" not in msg and "unknown kind 'nope'" in msg
    assert "expected one of builtin, gguf, hf, served" in msg


# --------------------------------------------------------------------------- declared options

from logitdiff.sources.base import parse_spec  # noqa: E402
from logitdiff.sources.options import ALIASES, OPTIONS, OptionType, canonical_kind, is_served, parse_options  # noqa: E402

# one value of every type that must be refused, and the words its one-line error says
_BAD = {OptionType.POSITIVE_INT: ("0", "-3", "1.5", "many", "1e3", str(10**13)), OptionType.INT: ("x", "1.5"),
        OptionType.POSITIVE_NUMBER: ("0", "-1", "nan", "inf", "fast"), OptionType.BOOL: ("maybe", "2")}


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_every_declared_option_is_checked_by_its_type(kind):
    """Every option of every kind: its default when absent, a converted value when good, and
    one line naming the spec and the option for an unknown option or a bad value."""
    defaults = parse_options(parse_spec(f"{kind}:T"))
    assert defaults == {o.name: o.default for o in OPTIONS[kind]}
    for o in OPTIONS[kind]:
        good = (o.choices[-1], o.choices[-1]) if o.type == OptionType.CHOICE else {
            OptionType.POSITIVE_INT: ("7", 7), OptionType.INT: ("-2", -2), OptionType.POSITIVE_NUMBER: ("2.5", 2.5),
            OptionType.BOOL: ("off", False), OptionType.TEXT: ("a|b", "a|b")}[o.type]
        assert parse_options(parse_spec(f"{kind}:T,{o.name}={good[0]}"))[o.name] == good[1]
        bad = _BAD.get(o.type, ("bogus",) if o.type == OptionType.CHOICE else ())
        for raw in bad:
            text = f"{kind}:T,{o.name}={raw}"
            with pytest.raises(LogitdiffError) as ei:
                parse_options(parse_spec(text))
            msg = str(ei.value)
            assert "\n" not in msg and repr(text) in msg and f"{o.name}={raw!r}" in msg, msg
    with pytest.raises(LogitdiffError, match=f"unknown option 'colour' \\({kind}: takes {OPTIONS[kind][0].name}, "):
        parse_options(parse_spec(f"{kind}:T,colour=red"))


def test_openai_is_another_name_for_served():
    assert ALIASES == {"openai": "served"} and canonical_kind("openai") == "served"
    assert is_served("openai:http://h:1") and is_served("served:http://h:1") and not is_served("gguf:x") and not is_served(None)
    assert parse_options(parse_spec("openai:http://h:1,top_k=8")) == parse_options(parse_spec("served:http://h:1,top_k=8"))
    from logitdiff.store.files import safe_name
    from logitdiff.capture.shards import with_endpoints
    from logitdiff.sources.registry import declared_row_kind

    assert declared_row_kind("openai:http://h:1") is declared_row_kind("served:http://h:1") is RowKind.TOPK
    assert safe_name("openai:http://h:8000/v1") == safe_name("served:http://h:8000/v1") == "h_8000_v1"
    assert with_endpoints("served:http://a:1", ["http://b:2"]) == "served:http://a:1,endpoints=http://b:2"
    with pytest.raises(LogitdiffError, match="unknown option 'colour' \\(openai: takes model, "):
        open_source("openai:http://127.0.0.1:9,colour=red")


def test_capture_help_lists_every_declared_option(capsys):
    from logitdiff.cli import main

    with pytest.raises(SystemExit):
        main(["capture", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for kind, opts in OPTIONS.items():
        assert f"{kind}:" in out.replace(" ", "") or f"{kind}:" in out
        for o in opts:
            assert f",{o.name}=" in out.replace(" ", ""), o.name


def test_register_a_kind(ladder):
    """A factory registered for a new kind opens its specs (here: a GGUF under another name)."""
    from logitdiff.sources.gguf import GGUFSource

    register("mygguf", lambda spec: GGUFSource(spec.target, spec=spec.text))
    try:
        assert "mygguf" in kinds()
        with open_source(f"mygguf:{ladder['Q8_0']}") as src:
            assert src.spec.startswith("mygguf:") and src.row_kind is RowKind.FULL
    finally:
        _FACTORIES.pop("mygguf")
    with pytest.raises(ValueError):
        register("a:b", lambda spec: None)


def test_topk_rows_and_blocks():
    """A top-K source's blocks: one per pair, rows at the selected positions, TopKRows typed."""
    K = 3

    class Fixed(TopKSource):
        top_k = K
        vocab_size = 10

        def score_many(self, batch):
            out = []
            for p, t in batch:
                ids = np.tile(np.arange(K, dtype=np.int64), (len(t), 1)) + np.arange(len(t))[:, None]
                out.append(TopKRows(ids, np.log(np.full((len(t), K), 0.25))))
            return out

    src = Fixed()
    assert src.row_kind is RowKind.TOPK
    blocks = list(src.score_blocks([([1], [1, 2, 3, 4]), ([1], [5]), ([2], [6, 7])], [[1, 3], [], None]))
    assert [(b.pair, b.t0, len(b.rows)) for b in blocks] == [(0, 0, 2), (2, 0, 2)]
    assert isinstance(blocks[0].rows, TopKRows) and blocks[0].rows.ids[:, 0].tolist() == [1, 3]
    assert set(blocks[0].rows.as_dict()) == {"ids", "logprobs"}
    assert TopKRows.empty(K).ids.shape == (0, K)
