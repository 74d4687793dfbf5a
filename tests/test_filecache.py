"""Facts kept per file version in $LOGITDIFF_CACHE (sources/filecache.py): a source opened
the second time computes nothing it computed the first time, and never serves a stale fact
for a changed file; the cached token texts are exactly the per-id ``token_text``."""

from __future__ import annotations

import os
import shutil

import pytest

from logitdiff.sources import file_sha256
from logitdiff.store import filecache as fc


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_file_hash_is_cached_and_follows_every_change(cache, tmp_path):
    """A rewrite of a file -- longer, or the same length with other bytes and its old mtime
    put back -- gives the new hash; an unchanged file is not read again."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    assert fc.file_sha256_cached(f) == file_sha256(f)
    entries = list((cache / "sha256").iterdir())
    assert len(entries) == 1
    entries[0].write_bytes(b"sha256:" + b"0" * 64)  # what a cached read returns: not recomputed
    assert fc.file_sha256_cached(f) == "sha256:" + "0" * 64
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: ctime (and the inode's) still move
    assert fc.file_sha256_cached(f) == file_sha256(f)
    f.write_bytes(b"b" * 1001)
    assert fc.file_sha256_cached(f) == file_sha256(f)
    g = tmp_path / "g.bin"
    shutil.copy2(f, g)  # same bytes and mtime, another path
    assert fc.file_sha256_cached(g) == file_sha256(f)


def test_cached_json_keys_on_contents_versions_and_name(cache, tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return ["x\udc80", len(calls)]  # a lone surrogate survives the round trip

    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    assert fc.cached_json("n", [f], {"v": 1}, compute) == ["x\udc80", 1]
    assert fc.cached_json("n", [f], {"v": 1}, compute) == ["x\udc80", 1]
    assert fc.cached_json("n", [f], {"v": 2}, compute) == ["x\udc80", 2]
    assert fc.cached_json("m", [f], {"v": 1}, compute) == ["x\udc80", 3]
    f.write_text('{"a": 1}')
    assert fc.cached_json("n", [f], {"v": 1}, compute) == ["x\udc80", 4]
    for p in (cache / "derived").iterdir():  # a damaged entry is recomputed, not served
        p.write_bytes(b"{not json")
    assert fc.cached_json("n", [f], {"v": 1}, compute) == ["x\udc80", 5]


def test_file_dir_cached_keeps_whole_entries_of_one_file_version(cache, tmp_path):
    """A directory entry is made once per version of the file and versions: a second call
    loads it; an entry its loader fails on is computed again and replaced; a value ``save``
    refuses leaves no entry (nor a temporary); the file rewritten in place with the same size
    and its old mtime put back, or other versions, is computed again."""
    import json

    f = tmp_path / "model.gguf"
    f.write_bytes(b"abc")
    calls = []

    def compute():
        calls.append(1)
        return {"bytes": f.read_text(), "n": len(calls)}

    def save(value, d):
        (d / "value.json").write_text(json.dumps(value))
        return True

    def load(d):
        return json.loads((d / "value.json").read_text())

    assert fc.file_dir_cached(f, "conv", {"lib": 1}, compute, save, load) == {"bytes": "abc", "n": 1}
    assert fc.file_dir_cached(f, "conv", {"lib": 1}, compute, save, load) == {"bytes": "abc", "n": 1}
    (entry,) = (cache / "conv").iterdir()
    (entry / "value.json").write_text("{damaged")
    assert fc.file_dir_cached(f, "conv", {"lib": 1}, compute, save, load) == {"bytes": "abc", "n": 2}
    assert fc.file_dir_cached(f, "conv", {"lib": 1}, compute, save, load) == {"bytes": "abc", "n": 2}
    assert [p.name for p in (cache / "conv").iterdir()] == [entry.name]  # replaced, nothing left beside it
    assert fc.file_dir_cached(f, "conv", {"lib": 2}, compute, save, load)["n"] == 3
    assert fc.file_dir_cached(f, "refused", {}, compute, lambda v, d: False, load)["n"] == 4
    assert fc.file_dir_cached(f, "refused", {}, compute, lambda v, d: False, load)["n"] == 5
    assert list((cache / "refused").iterdir()) == []
    st = f.stat()
    f.write_bytes(b"abd")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fc.file_dir_cached(f, "conv", {"lib": 1}, compute, save, load) == {"bytes": "abd", "n": 6}


def test_json_cached_keys_on_the_key_alone(cache):
    calls = []

    def compute():
        calls.append(1)
        return [[1, 2], [len(calls)]]

    assert fc.json_cached("ids", {"digest": "a", "texts": "t"}, compute) == [[1, 2], [1]]
    assert fc.json_cached("ids", {"texts": "t", "digest": "a"}, compute) == [[1, 2], [1]]  # key order: the same key
    assert fc.json_cached("ids", {"digest": "b", "texts": "t"}, compute) == [[1, 2], [2]]
    assert fc.json_cached("ids", {"digest": "a", "texts": "t"}, compute, valid=lambda v: len(v) == 3) == [[1, 2], [3]]


def test_cache_off_and_unwritable(tmp_path, monkeypatch):
    f = tmp_path / "a"
    f.write_bytes(b"1")
    monkeypatch.setenv("LOGITDIFF_CACHE", "off")
    assert fc.file_sha256_cached(f) == file_sha256(f)
    assert fc.cached_json("n", [f], {}, lambda: 7) == 7
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LOGITDIFF_CACHE", str(blocker / "sub"))  # below a regular file: cannot be created
    assert fc.file_sha256_cached(f) == file_sha256(f)
    assert fc.cached_json("n", [f], {}, lambda: 8) == 8


def test_hf_token_texts_equal_token_text_and_are_cached(cache, tmp_path):
    """The batched decode of all ids equals ``token_text`` id by id (byte-level fragments
    fall back to the raw token), and a second open reads them from the cache; a changed
    tokenizer file gives new texts."""
    from logitdiff.builtin import TINY_DIR
    from logitdiff.sources import open_source

    model = tmp_path / "m"
    shutil.copytree(TINY_DIR, model)
    src = open_source(f"hf:{model}")
    texts = src.token_texts()
    assert texts == [src.token_text(i) for i in range(src.vocab_size)]
    assert any("\ufffd" not in t and t != src.detokenize([i]) for i, t in enumerate(texts))  # fallbacks happen
    assert len(list((cache / "derived").iterdir())) == 2  # the tokens and the texts (the tokenizer hash is computed: ~25 ms, and keys them)
    again = open_source(f"hf:{model}")
    again.tok.backend_tokenizer.decode_batch = None  # a cached read needs no decode
    assert again.token_texts() == texts and again.tokenizer_hash == src.tokenizer_hash
    assert again.identity()["weight_files"] == src.identity()["weight_files"]
    cfg = (model / "tokenizer_config.json").read_text()
    (model / "tokenizer_config.json").write_text(cfg + "\n")
    third = open_source(f"hf:{model}")
    assert third.token_texts() == texts  # same texts, computed again (another key)
    assert len(list((cache / "derived").iterdir())) == 4


def test_hf_tokenizer_tokens_are_cached_per_version_of_every_file(cache, tmp_path):
    """The token strings (what tokenizer_hash is of) are read from the cache on a second
    open, equal to convert_ids_to_tokens; a changed tokenizer file, a new or changed other
    file of the directory, or a damaged entry gives them computed again."""
    from logitdiff.builtin import TINY_DIR
    from logitdiff.sources import open_source

    model = tmp_path / "m"
    shutil.copytree(TINY_DIR, model)
    first = open_source(f"hf:{model}")
    want = first.tok.convert_ids_to_tokens(list(range(len(first.tok))))
    assert first.tokenizer_tokens == want
    calls = []
    real = type(first.tok).convert_ids_to_tokens

    def counting(self, ids, *a, **k):
        if isinstance(ids, list) and len(ids) == len(want):
            calls.append(1)
        return real(self, ids, *a, **k)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(first.tok), "convert_ids_to_tokens", counting)
        again = open_source(f"hf:{model}")
        assert again.tokenizer_tokens == want and again.tokenizer_hash == first.tokenizer_hash and calls == []
        (model / "notes.txt").write_text("a file the tokenizer might read")  # another file: its identity is in the key
        assert open_source(f"hf:{model}").tokenizer_tokens == want and len(calls) == 1
        cfg = model / "tokenizer_config.json"
        cfg.write_text(cfg.read_text() + "\n")  # a tokenizer file's contents
        assert open_source(f"hf:{model}").tokenizer_tokens == want and len(calls) == 2
        for entry in (cache / "derived").iterdir():  # damaged entries: valid JSON of the wrong shape
            entry.write_text('["x"]')
        damaged = open_source(f"hf:{model}")
        assert damaged.tokenizer_tokens == want and len(calls) == 3
        assert damaged.token_texts() == first.token_texts()  # the texts' entry was damaged too


def test_cache_off_never_builds_into_a_folder_named_off(tmp_path, monkeypatch):
    """LOGITDIFF_CACHE=off once sent built quants into ./off (the value read as a path)."""
    from logitdiff.sources.quantize import default_cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOGITDIFF_CACHE", "off")
    d = default_cache_dir()
    assert d.is_absolute() and d.name.startswith("logitdiff-uncached-") and tmp_path not in d.parents
    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
