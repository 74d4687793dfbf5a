"""Output paths: what a command may replace, one writer at a time, and swap on success.

Every command that writes goes through :func:`writing`:

1. **guard** (:func:`check_output`): an existing ``--out`` is replaced only when it is
   the same kind of logitdiff output (a RUN for a run, a REPORT for a report, a page this
   tool wrote for ``report --out``; an empty directory counts as free), and, where the
   command has ``--overwrite``, only with it. Anything else — a source tree, a regular
   file, a symlink, the command's own input, a path inside or around an input, the
   current directory, a path below a regular file — is a one-line error and stays
   untouched.
2. **lock**: an exclusive ``fcntl.flock`` on ``.NAME.lock`` beside the output for the
   whole write. A second writer fails at once naming the holder's pid; the kernel drops
   the lock when its holder dies, so a killed process never blocks the next one.
3. **build beside, swap on success**: the new output is written to a temporary sibling
   ``.NAME.tmp-PID-TOKEN`` and renamed over the old one only when complete. On an error,
   Ctrl-C or SIGTERM the temporary is removed and the old output is as it was.

A capture into a new directory is the one exception to 3: it writes in place so that
``capture --resume`` can continue it after a kill (``in_place_when_new``).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from ..errors import LogitdiffError
from ..contracts import DOCUMENT_MAX_BYTES, SNIFF_BYTES, input_stat, open_input, read_input_bytes, read_input_json  # noqa: F401 - the inputs' helpers, here with the outputs'
from ..contracts import HTML_DATA_SCHEMA, HTML_GENERATOR_META, LAYERS_SCHEMA, QUANTIZE_SCHEMA, REPORT_SCHEMAS, RUN_SCHEMA, RUN_SUMMARY_SCHEMA, SPECULATION_SCHEMA, TOPK_ERROR_SCHEMA


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """One file, whole or not at all, written by name (by llama.cpp's quantizer, gguf's
    writer, or the caller): the yielded path is a temporary sibling, renamed over ``path``
    when the block ends without an error and removed otherwise (the one temp-file-and-rename
    writer of the package; :func:`atomic_file` and every other writer go through it). One
    writer per path at a time (the name is per process)."""
    path = Path(path)
    # ".NAME.tmpPID": the name _ATOMIC_TMP and a RUN's resume sweep know as a write temporary
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise write_error(path, e) from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """One file, whole or not at all: the caller writes to the yielded binary file (a
    temporary sibling, see :func:`atomic_path`), flushed to disk before it is renamed."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(path, e) from None


@contextmanager
def atomic_file_unsynced(path: str | Path) -> Iterator[BinaryIO]:
    """:func:`atomic_file` without the fsync: whole or not at all for a killed process, but
    not yet durable; the caller must :func:`fsync_path` it before anything that says it is
    there (a RUN's manifest) is made durable. Writeback is started when the file is
    complete (:func:`start_writeback`), so the later fsync mostly finds it done."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            yield f
            f.flush()
            start_writeback(f.fileno())
    except OSError as e:
        raise write_error(path, e) from None


def fsync_path(path: str | Path) -> None:
    """Make a file written by :func:`atomic_file_unsynced` durable (fsync by name: it syncs
    the file, not the descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error(path, e) from None


@functools.lru_cache(maxsize=None)
def _sync_file_range():
    """libc's sync_file_range (Linux), or None (looked up once)."""
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk now, without waiting for it
    (sync_file_range(SYNC_FILE_RANGE_WRITE) on Linux; elsewhere nothing: the fsync that
    follows does all the work). Advisory: errors surface at that fsync."""
    sfr = _sync_file_range()
    if sfr is not None:
        sfr(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """``data`` as the whole file ``path`` (see atomic_file)."""
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_bytes_unsynced(path: str | Path, data: bytes) -> None:
    """``data`` as the whole file ``path``, not yet durable (see atomic_file_unsynced)."""
    with atomic_file_unsynced(path) as f:
        f.write(data)


# O_DIRECT writes: memory address, file offset and length of each are multiples of this (the
# page size; the strictest logical block size a Linux file system asks for is 4096).
DIRECT_ALIGN = 4096
# The staging buffer a direct writer gathers bytes in; each full buffer is one write(), which
# the block layer splits into several requests in flight at once.
DIRECT_STAGE_BYTES = 16 << 20
# A transparent huge page (x86-64, arm64 with 4 KiB pages): a staging buffer of at least one
# is placed on these boundaries and advised MADV_HUGEPAGE (see direct_stage).
HUGE_PAGE = 2 << 20


def direct_stage(nbytes: int | None = None):
    """A page-aligned staging buffer of ``nbytes`` (default DIRECT_STAGE_BYTES) for
    :func:`atomic_file_direct` (anonymous memory, reused by its owner across files: its pages
    are faulted in once).

    A buffer of a huge page or more sits on HUGE_PAGE boundaries, advised MADV_HUGEPAGE, so
    that the kernel backs it with transparent huge pages where it can (THP "always" or
    "madvise"): every O_DIRECT write pins the buffer's pages and hands them to the device as
    segments, 8 huge pages for 16 MiB instead of 4,096 small ones, and physically contiguous
    2 MiB segments fill a request with a few segments instead of the queue's segment limit
    (254 here: a 4 MiB request cut into ~1 MiB ones). On this VM that cut the writer's system
    CPU ~7x and what a concurrent 2-thread matmul lost to a 512 MiB write ~2x (bench/RESULTS.md,
    issue 24 "huge pages"). Where the advice is unknown or refused, or no huge page is free,
    the same buffer is ordinary pages: nothing else changes."""
    import mmap

    nbytes = DIRECT_STAGE_BYTES if nbytes is None else nbytes
    size = max(DIRECT_ALIGN, nbytes // DIRECT_ALIGN * DIRECT_ALIGN)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or size < HUGE_PAGE:
        return mmap.mmap(-1, size)
    span = -(-size // HUGE_PAGE) * HUGE_PAGE  # the huge pages the buffer lies in
    # private: huge pages for anonymous memory follow THP's "enabled"; a shared mapping
    # (mmap's default) is shmem, whose huge pages are off unless "shmem_enabled" says otherwise
    raw = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to start on a boundary
    import ctypes

    at = ctypes.c_char.from_buffer(raw)
    skip = -ctypes.addressof(at) % HUGE_PAGE
    del at  # the export: a live one would keep the mapping from being closed
    try:
        raw.madvise(advice, skip, span)
    except OSError:  # a kernel without THP: ordinary pages
        pass
    return memoryview(raw)[skip : skip + size]


# File systems whose files live in the page cache (shmem, ramfs): O_DIRECT spares them no copy
# (tmpfs accepts it since Linux 6.6 and copies through the page cache all the same), so the
# staging copy would be one copy more.
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


def direct_io_pays(directory: str | Path) -> bool:
    """Whether writing files in ``directory`` with O_DIRECT spares the page-cache copy: the
    platform has O_DIRECT and the directory is not on a memory file system (its mount's type
    from /proc/self/mountinfo; where that cannot be read, assume it pays: a refusal of
    O_DIRECT still falls back, see DirectFile)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        dev = os.stat(directory).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                major, minor = fields[2].split(":")
                if os.makedev(int(major), int(minor)) == dev:
                    return fields[fields.index("-") + 1] not in _MEMORY_FILE_SYSTEMS
    except (OSError, ValueError, IndexError):
        pass
    return True


# A block at least this large is written from the caller's memory where its alignment allows
# (DirectFile.write): below it the staging copy costs less than the extra write() calls.
DIRECT_FROM_CALLER_MIN = 256 << 10


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """(memory, file offset) alignment that O_DIRECT I/O on the open file ``fd`` needs, as the
    kernel reports it (statx STATX_DIOALIGN: Linux >= 6.1, regular files of ext4, xfs, btrfs
    and block devices), or None where it is not reported (then DIRECT_ALIGN for both is what
    this module assumes). Here, ext4 on virtio: 512 and 512."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # a C library without statx (glibc < 2.28, musl < 1.2.5)
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx
    at_empty_path, statx_dioalign = 0x1000, 0x2000
    if statx(ctypes.c_int(fd), b"", ctypes.c_int(at_empty_path), ctypes.c_uint(statx_dioalign), buf) != 0:
        return None
    raw = buf.raw
    if not int.from_bytes(raw[0:4], "little") & statx_dioalign:  # stx_mask: not reported
        return None
    mem, off = int.from_bytes(raw[152:156], "little"), int.from_bytes(raw[156:160], "little")
    if not mem or not off or mem & (mem - 1) or off & (off - 1):  # 0: no direct I/O; powers of two only
        return None
    return mem, off


class DirectFile:
    """The binary file being written by :func:`atomic_file_direct`: ``write(buffer)`` takes any
    C-contiguous buffer. With O_DIRECT the device reads the bytes from the staging buffer: no
    copy into the page cache and no writeback by the kernel afterwards (on this project's VM
    those were ~0.4 CPU s per 0.5 GB, beside the model's forward). ``direct`` says whether
    O_DIRECT is in use: a file system that refuses it (EINVAL at open, or at a write: tmpfs
    before Linux 6.6, some FUSE and network file systems, alignments beyond DIRECT_ALIGN)
    gets the same bytes, in order, through the page cache, writeback started after each
    ``write``. ``head``, when set before the file is finished
    (a multiple of DIRECT_ALIGN bytes), replaces the file's first bytes: a header that
    describes what follows it, written after it."""

    def __init__(self, path: Path, stage, direct: bool = True):
        self.path = path
        self.head = b""
        self._stage = memoryview(stage) if stage is not None else memoryview(b"")
        self._fill = 0  # bytes gathered in the staging buffer, not yet written
        self._size = 0  # bytes the file will hold
        self._written = 0  # bytes written to the file (direct: multiples of DIRECT_ALIGN)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT") and len(self._stage) >= DIRECT_ALIGN
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o666)
        # what O_DIRECT needs of a write from the caller's memory (the staging buffer meets
        # DIRECT_ALIGN, the strictest; finer alignments let more blocks skip the copy)
        align = dio_alignment(self.fd) if self.direct else None
        self._mem_align, self._off_align = (
            align if align is not None and max(align) <= DIRECT_ALIGN else (DIRECT_ALIGN, DIRECT_ALIGN))

    def write(self, data) -> int:
        mv = memoryview(data)
        if mv.nbytes == 0:
            return 0  # an empty block (cast("B") refuses a view with a zero in its shape)
        mv = mv.cast("B")
        n = len(mv)
        if not self.direct:
            self._write_all(mv)
            start_writeback(self.fd)
        else:
            import numpy as np

            # numpy's copy lets go of the GIL (a memoryview's does not): the caller's thread
            # runs on while a large block is staged
            stage, src = np.frombuffer(self._stage, np.uint8), np.frombuffer(mv, np.uint8)
            cap, o = len(stage), self._write_from_caller(mv, src)
            while o < n:
                if not self.direct:  # refused (nothing is staged then): the rest through the page cache
                    self._write_all(mv[o:])
                    start_writeback(self.fd)
                    break
                k = min(cap - self._fill, n - o)
                stage[self._fill : self._fill + k] = src[o : o + k]
                self._fill += k
                o += k
                if self._fill == cap:
                    self._write_stage(cap)
        self._size += n
        return n

    def _write_all(self, mv: memoryview) -> None:
        while len(mv):
            k = os.write(self.fd, mv)
            self._written += k
            mv = mv[k:]

    def _page_cache_from_here(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def _write_from_caller(self, mv: memoryview, src) -> int:
        """Where ``mv`` (``src``: the same bytes as a numpy array) is large and its memory lies
        as O_DIRECT needs it once the staged bytes are topped up to the file offset alignment:
        stage the few bytes that top them up, write the staged bytes, then write the aligned
        middle of ``mv`` to the device straight from the caller's memory (no staging copy: a
        page-aligned block of rows, e.g. rowpool.RowPool's, whose size is a multiple of the
        offset alignment, goes whole). Returns the bytes of ``mv`` done; the rest is staged
        by the caller. The caller's buffer must not change until this returns (write() is
        synchronous)."""
        n, off = len(mv), self._off_align
        if not self.direct or n < DIRECT_FROM_CALLER_MIN:
            return 0
        top = -self._fill % off  # bytes that bring the staged ones to an offset boundary
        if self._fill + top > len(self._stage) or (src.ctypes.data + top) % self._mem_align or n - top < off:
            return 0
        if top:
            self._stage[self._fill : self._fill + top] = mv[:top]
            self._fill += top
        if self._fill:
            self._write_stage(self._fill)
        middle = (n - top) // off * off
        self._write_aligned(mv[top : top + middle])
        return top + middle

    def _write_stage(self, nbytes: int) -> None:
        """The first ``nbytes`` of the staging buffer (a multiple of the file offset alignment) to the file."""
        self._write_aligned(self._stage[:nbytes])
        self._fill = 0

    def _write_aligned(self, mv: memoryview) -> None:
        """``mv`` (memory, length and the file's end aligned as O_DIRECT needs) to the file's end."""
        while len(mv):
            try:
                k = os.write(self.fd, mv)
            except OSError as e:
                # O_DIRECT accepted at open but not for this write (alignment the file system
                # wants beyond DIRECT_ALIGN, or no direct I/O at all): the page cache from here on
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._page_cache_from_here()
                continue
            self._written += k
            mv = mv[k:]
        if not self.direct:
            start_writeback(self.fd)

    def finish(self) -> None:
        """The last, partial, staging buffer written padded to DIRECT_ALIGN, the file cut to
        the bytes given (the padding never reaches the file's final name), ``head`` over the
        first bytes."""
        head = self.head
        if len(head) % DIRECT_ALIGN or len(head) > self._size or (self.direct and len(head) > len(self._stage)):
            raise ValueError(f"a head of {len(head)} bytes over a file of {self._size}")
        if head and self.direct and self._written == 0:  # the first bytes are still staged
            self._stage[: len(head)] = head
            head = b""
        if self._fill:
            fill = self._fill
            pad = -fill % DIRECT_ALIGN
            self._stage[fill : fill + pad] = bytes(pad)
            self._write_stage(fill + pad)
            if self._written != self._size:
                os.ftruncate(self.fd, self._size)
        if head:
            out: bytes | memoryview = head
            if self.direct:  # from aligned memory: the staging buffer, free now
                self._stage[: len(head)] = head
                out = self._stage[: len(head)]
            try:
                k = os.pwrite(self.fd, out, 0)
            except OSError as e:
                # the file's writes so far filled whole staging buffers, so none probed a
                # write this small: refused under O_DIRECT, it goes through the page cache
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._page_cache_from_here()
                k = os.pwrite(self.fd, bytes(out), 0)
            if k != len(head):
                raise OSError(errno.EIO, "short write of the file's head")
            if not self.direct:
                start_writeback(self.fd)


@contextmanager
def atomic_file_direct(path: str | Path, stage, direct: bool = True) -> Iterator[DirectFile]:
    """:func:`atomic_file_unsynced` written with O_DIRECT through ``stage`` (:func:`direct_stage`;
    one writer at a time per buffer), or through the page cache where the file system refuses
    O_DIRECT or ``direct`` is false (:func:`direct_io_pays`; ``stage`` may then be None).
    Whole or not at all for a killed process, not yet durable: the caller must
    :func:`fsync_path` it (the device's write cache and the file's metadata) before anything
    that says it is there is made durable."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            f = DirectFile(tmp, stage, direct)
            try:
                yield f
                f.finish()
            finally:
                os.close(f.fd)
    except OSError as e:
        raise write_error(path, e) from None


def write_error(path: str | Path, e: OSError) -> LogitdiffError:
    """One line for a failed write: the path and why (a full disk says so)."""
    if e.errno == errno.ENOSPC:
        return LogitdiffError(f"{path}: no space left on device")
    return LogitdiffError(f"{path}: cannot write ({e.strerror or type(e).__name__})")


def atomic_write_json(path: str | Path, obj, *, indent: int | None = 1) -> None:
    """``obj`` as JSON (non-JSON values as ``str``), through :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, default=str) + "\n").encode())



# --------------------------------------------------------------------------------------
# inputs: every file a command reads is opened by open_input / read_input_bytes /
# read_input_json / input_stat (defined in contracts, the base stage, so that its loaders of
# report.json and summary.json read through them too; re-exported here)
# --------------------------------------------------------------------------------------

def dir_identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of a directory, None when it is not there: a REPORT replaced by a
    writer (a temporary renamed over it) gets a new inode, so a reader that reads several
    of its files compares this before and after (:func:`same_directory`)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextmanager
def same_directory(path: str | Path) -> Iterator[None]:
    """The block reads several files of the directory ``path`` (a REPORT's report.json and
    tokens.parquet) as one version: a one-line error when another command replaced the
    directory meanwhile (logitdiff's writers swap a whole directory, never a file in it:
    :func:`writing`), instead of figures of one report beside tokens of the other."""
    before = dir_identity(path)
    yield
    if dir_identity(path) != before:
        raise LogitdiffError(f"{path}: replaced by another command while it was read; run this one again")


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _walk_down(root: str | Path, visit: "_FindFile | _RemoveAll") -> bool:
    """Depth-first through the tree below the directory ``root`` holding one descriptor at a
    time (each directory opened relative to its parent, left through ``..``): no recursion
    (os.walk and shutil.rmtree recurse once per level in Python 3.11: 3,000 nested
    directories stopped them with a RecursionError), no path beyond PATH_MAX, no descriptor
    per level. ``visit(fd, entries)`` sees each directory's entries (os.DirEntry, symlinks
    not followed) and returns the names of the subdirectories to enter next and whether to
    stop; ``leave(fd, name)`` is called as ``(fd of the parent, name)`` once a subdirectory
    is done (None: nothing). Returns False when stopped, True when walked whole."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return True
    todo: list[list[str]] = []  # per level: its subdirectories still to enter
    names: list[str] = []  # the subdirectory entered at each level
    try:
        while True:
            try:
                with os.scandir(fd) as it:
                    entries = list(it)
            except OSError:
                entries = []
            subdirs, stop = visit(fd, entries)
            if stop:
                return False
            todo.append(list(subdirs))
            while True:
                while todo and todo[-1]:
                    name = todo[-1].pop()
                    try:
                        nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        continue
                    os.close(fd)
                    fd = nfd
                    names.append(name)
                    break
                else:
                    todo.pop()
                    if not names:
                        return True
                    up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = up
                    visit.leave(fd, names.pop())
                    continue
                break
    finally:
        os.close(fd)


class _FindFile:
    """`_walk_down` visitor: stop at the first entry that is not a directory."""

    def __call__(self, fd: int, entries: list) -> tuple[list[str], bool]:
        subdirs = []
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                return [], True
            subdirs.append(e.name)
        return subdirs, False

    def leave(self, fd: int, name: str) -> None:
        pass


class _RemoveAll:
    """`_walk_down` visitor: unlink every non-directory, remove each directory once left."""

    def __call__(self, fd: int, entries: list) -> tuple[list[str], bool]:
        subdirs = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                subdirs.append(e.name)
            else:
                try:
                    os.unlink(e.name, dir_fd=fd)
                except OSError:
                    pass
        return subdirs, False

    def leave(self, fd: int, name: str) -> None:
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            pass


def holds_no_files(path: str | Path) -> bool:
    """No file anywhere below the directory ``path`` (stops at the first one found; a
    directory it cannot open counts as empty, as os.walk took it), at any depth."""
    return _walk_down(path, _FindFile())


def remove_tree(path: str | Path) -> None:
    """Remove the directory ``path`` and everything below it, at any depth; symlinks are
    removed, never followed; what cannot be removed stays (as rmtree(ignore_errors=True))."""
    _walk_down(path, _RemoveAll())
    try:
        os.rmdir(path)
    except OSError:
        pass


class Kind(enum.Enum):
    """What a command writes; ``value`` is how error messages name it."""

    RUN = "RUN directory"
    REPORT = "REPORT directory"
    RUN_OUT = "`logitdiff run` output directory"
    HTML = "logitdiff HTML page"
    TOPK_JSON = "topk-error JSON file"
    LAYERS = "layers REPORT directory"
    SPECULATION = "`logitdiff speculate` output directory"
    QUANT = "`logitdiff quantize` output directory"

    @property
    def is_dir(self) -> bool:
        return self in (Kind.RUN, Kind.REPORT, Kind.RUN_OUT, Kind.LAYERS, Kind.SPECULATION, Kind.QUANT)


_SCHEMA_FIRST = re.compile(rb'\A\s*\{\s*"schema"\s*:\s*("(?:[^"\\]|\\.)*")')


def _json_schema(path: Path) -> str | None:
    """The ``schema`` of a JSON object file. Our files write it as the first key, so a big
    report.json is recognised from its head; anything else is parsed whole (when small)."""
    try:
        # a FIFO, a device (/dev/zero) or a file beyond DOCUMENT_MAX_BYTES is no logitdiff output
        with open_input(path, max_bytes=DOCUMENT_MAX_BYTES) as f:
            head = f.read(SNIFF_BYTES)
            m = _SCHEMA_FIRST.match(head)
            if m:
                return json.loads(m.group(1))
            if os.fstat(f.fileno()).st_size > (16 << 20):
                return None
            return json.loads(head + f.read(16 << 20)).get("schema")
    except (OSError, ValueError, AttributeError, RecursionError, LogitdiffError):
        return None


def _file_contains(path: Path, needle: bytes, limit: int = 256 << 20) -> bool:
    """Whether ``needle`` occurs in the first ``limit`` bytes, read in blocks (pages are MBs)."""
    try:
        with open_input(path, max_bytes=1 << 62) as f:  # read in blocks up to ``limit``, never whole
            tail = b""
            done = 0
            while done < limit:
                block = f.read(1 << 20)
                if not block:
                    return False
                if needle in tail + block:
                    return True
                tail = block[-len(needle):]
                done += len(block)
    except (OSError, LogitdiffError):
        return False
    return False


def is_kind(path: Path, kind: Kind) -> bool:
    """Whether an existing path is a logitdiff output of this kind (by its own markers)."""
    path = Path(path)
    if kind is Kind.RUN:
        return path.is_dir() and _json_schema(path / "manifest.json") == RUN_SCHEMA
    if kind is Kind.REPORT:
        return path.is_dir() and _json_schema(path / "report.json") in REPORT_SCHEMAS  # a 1.x report too
    if kind is Kind.RUN_OUT:
        return path.is_dir() and (
            _json_schema(path / "summary.json") == RUN_SUMMARY_SCHEMA or is_kind(path / "runs" / "reference", Kind.RUN)
        )
    if kind is Kind.HTML:
        if not path.is_file():
            return False
        try:
            with open_input(path, max_bytes=1 << 62) as f:  # the page is sniffed, not read whole
                head = f.read(SNIFF_BYTES)
        except LogitdiffError:
            return False
        return head.lstrip().lower().startswith(b"<!doctype html") and (
            HTML_GENERATOR_META.encode() in head or _file_contains(path, HTML_DATA_SCHEMA.encode())
        )
    if kind is Kind.SPECULATION:
        return path.is_dir() and _json_schema(path / "report.json") == SPECULATION_SCHEMA
    if kind is Kind.TOPK_JSON:
        return path.is_file() and _json_schema(path) == TOPK_ERROR_SCHEMA
    if kind is Kind.LAYERS:
        return path.is_dir() and _json_schema(path / "layers.json") == LAYERS_SCHEMA
    if kind is Kind.QUANT:
        return path.is_dir() and _json_schema(path / "quantize.json") == QUANTIZE_SCHEMA
    raise AssertionError(kind)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_output(
    out: str | Path,
    kind: Kind,
    *,
    inputs: Sequence[str | Path] = (),
    overwrite: bool | None = None,
    resume: bool = False,
) -> None:
    """Raise a one-line :class:`LogitdiffError` unless ``out`` may be written as ``kind``.

    ``overwrite`` is None for commands without ``--overwrite`` (they replace their own
    kind of output freely); ``resume`` (capture) accepts an existing RUN to continue."""
    out = Path(out)
    if not str(out) or out.name in ("", ".", ".."):
        raise LogitdiffError(f"--out {str(out)!r}: name a file or directory to write, not {str(out) or 'an empty path'!r}")
    name_max = 255
    try:
        name_max = os.pathconf(next((p for p in out.absolute().parents if p.is_dir()), "/"), "PC_NAME_MAX")
    except (OSError, ValueError):
        pass
    size = len(os.fsencode(out.name))
    if size + TEMP_NAME_EXTRA > name_max:
        raise LogitdiffError(f"--out {_short_name(out)}: its name is {size} bytes; at most "
                             f"{name_max - TEMP_NAME_EXTRA} (the file system allows {name_max} and the temporary "
                             f"written beside it adds {TEMP_NAME_EXTRA})")
    if out.is_symlink():
        raise LogitdiffError(f"{out}: is a symbolic link; refusing to replace it (name the real path)")
    real = _real(out)
    for anc in reversed(real.parents):
        if anc.exists() and not anc.is_dir():
            raise LogitdiffError(f"{out}: below {anc}, which is a regular file, not a directory")
    cwd = _real(Path.cwd())
    if real == cwd or real in cwd.parents:
        raise LogitdiffError(f"{out}: is the current directory or contains it; name a new directory for --out")
    for given in inputs:
        if given is None:
            continue
        inp = _real(Path(given))
        if real == inp:
            raise LogitdiffError(f"{out}: is the input {given}; --out must not overwrite what the command reads")
        if inp in real.parents:
            raise LogitdiffError(f"{out}: is inside the input {given}; --out must not write into what the command reads")
        if real in inp.parents:
            raise LogitdiffError(f"{out}: contains the input {given}; --out must not replace what the command reads")
    if not out.exists():
        return
    if kind.is_dir:
        if not out.is_dir():
            raise LogitdiffError(f"{out}: exists and is not a directory; refusing to replace it with a {kind.value}")
        if holds_no_files(out):
            return  # nothing to lose: empty, or only empty directories (an interrupted start)
        if kind is Kind.RUN and _unstarted_run(out):
            return  # a capture killed before its manifest existed: only its own files
    elif out.is_dir():
        raise LogitdiffError(f"{out}: is a directory; --out names the file to write (a {kind.value})")
    if not is_kind(out, kind):
        raise LogitdiffError(
            f"{out}: exists and is not a {kind.value}; refusing to replace it (remove it yourself or choose another --out)"
        )
    if resume:
        return
    if overwrite is False:
        hint = "--resume to continue it or --overwrite to replace it" if kind is Kind.RUN else "--overwrite to replace it"
        raise LogitdiffError(f"{out}: already holds a {kind.value} (use {hint})")


def _short_name(out: Path) -> str:
    s = str(out)
    return s if len(s) <= 80 else s[:40] + "..." + s[-30:]


# what a RunWriter writes before its manifest (older versions wrote these first), and the
# temporaries of atomic_write_bytes (".NAME.tmpPID")
_PRE_MANIFEST = {"vocab.json", "head.npy"}
_ATOMIC_TMP = re.compile(r"\A\.[^/]+\.tmp[0-9]+\Z")


def _unstarted_run(path: Path) -> bool:
    """A directory holding only what a capture writes before its manifest: ``chunks/``
    (empty, or only temporaries), ``vocab.json``, ``head.npy`` and write temporaries."""
    try:
        names = os.listdir(path)
        if "chunks" not in names or "manifest.json" in names:
            return False
        for name in names:
            p = path / name
            if name == "chunks":
                if not p.is_dir() or p.is_symlink() or not all(_ATOMIC_TMP.match(n) for n in os.listdir(p)):
                    return False
            elif not ((name in _PRE_MANIFEST or _ATOMIC_TMP.match(name)) and p.is_file() and not p.is_symlink()):
                return False
    except OSError:
        return False
    return True


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


# The outputs this process holds the lock of: real path -> (thread id, depth). flock is
# per open file, so a second flock on the same lock file by the holder itself would be
# refused; the holding thread re-enters instead (a command's whole run holds the lock and
# its final write takes it again; `writing` holds it and the RunWriter it opens on the
# yielded path takes it again). Another thread of this process is refused like another
# process. This mirrors the kernel's locks; nothing else reads it.
_HELD: dict[str, tuple[int, int]] = {}
_HELD_MUTEX = threading.Lock()


def held_key(out: Path) -> str:
    """The key of an output in this process's lock bookkeeping (its real path)."""
    return str(_real(out))


@contextmanager
def _holding(key: str, out: Path) -> Iterator[bool]:
    """Count this thread in on ``key``; yields whether it already held it (re-entered)."""
    me = threading.get_ident()
    with _HELD_MUTEX:
        owner, depth = _HELD.get(key, (me, 0))
        if owner != me:
            raise LogitdiffError(
                f"{out}: another thread of this logitdiff process (pid {os.getpid()}) is writing it; wait for it or choose "
                "another --out")
        _HELD[key] = (me, depth + 1)
    try:
        yield depth > 0
    finally:
        with _HELD_MUTEX:  # the current depth: an inner holder may have let go out of order
            depth = _HELD[key][1] - 1
            if depth:
                _HELD[key] = (me, depth)
            else:
                del _HELD[key]


@contextmanager
def locked(out: str | Path, *, made: list[Path] | None = None) -> Iterator[None]:
    """Exclusive lock on ``out`` (``.NAME.lock`` beside it) for the block; never waits.
    The thread that holds it may take it again (nested blocks share the one lock).

    ``made``: the directories the caller created for ``out`` (:func:`_make_parents`): when
    the block fails, those left empty are removed before the lock is let go. A writer that
    fails so may remove them between another's ``_make_parents`` and its lock: that one makes
    them again (added to its ``made``) instead of failing on a directory that vanished."""
    out = Path(out)
    with _holding(held_key(out), out) as again:
        if again:
            yield
            return
        with _flocked(out, made):
            yield


# times a writer makes its directory again when another writer letting go removed it
_PARENT_RETRIES = 8


@contextmanager
def _flocked(out: Path, made: list[Path] | None = None) -> Iterator[None]:
    path = lock_path(out)
    retries = _PARENT_RETRIES
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError as e:
            # the directory is gone: a writer that had created it failed and removed it
            # (the only way it goes between our making it and here); make it again
            if retries == 0:
                raise LogitdiffError(f"{out}: cannot write there ({e.strerror})") from None
            retries -= 1
            again = _make_parents(out)
            if made is not None:
                made.extend(d for d in again if d not in made)
                made.sort(key=lambda d: len(d.parts))
            continue
        except OSError as e:
            raise LogitdiffError(f"{out}: cannot write there ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LogitdiffError(
                    f"{out}: another logitdiff process (pid {holder}) is writing it; wait for it or choose another --out"
                ) from None
            raise LogitdiffError(f"{out}: cannot lock {path} ({e.strerror})") from None
        # The previous holder unlinks the lock file on release: if ours is no longer the
        # file at that name, lock the new one instead (else two writers could both "hold" it).
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    failed = False
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    except BaseException:
        failed = True
        raise
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        if failed and made:
            _remove_empty(made)  # still holding the lock (the lock file itself went just before)
            made.clear()
        os.close(fd)


@contextmanager
def reserved(
    out: str | Path,
    kind: Kind,
    *,
    inputs: Sequence[str | Path] = (),
    overwrite: bool | None = None,
) -> Iterator[None]:
    """Guard and lock ``out`` for the whole of a command whose work comes before its write
    (a comparison, a page, generation against servers, a layer sweep), with :func:`writing`
    inside the block (it re-enters the lock). A second writer is refused from the first
    one's start, not only during its final write: without this, both did the work and the
    last to finish replaced the other's output whole. Parents that did not exist are
    created (the lock file lives there) and removed again if the block fails."""
    out = Path(out)
    check_output(out, kind, inputs=inputs, overwrite=overwrite)
    created = _make_parents(out)
    try:
        with locked(out, made=created):
            yield
    except BaseException:
        _remove_empty(created)  # when the lock was refused (else already removed under it)
        raise


def _temp_sibling(out: Path, what: str) -> Path:
    """``.NAME.WHAT-PID-TOKEN``: the writer's pid (so a later writer can tell whether it is
    gone) and 8 random hex digits (so the name is ours, not a user's ``.NAME.tmp-notes``)."""
    return out.parent / f".{out.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"


# what _temp_sibling makes adds to NAME at most: ".", ".old-", a pid (<= 10 digits), "-", 8
TEMP_NAME_EXTRA = 1 + 5 + 10 + 1 + 8


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or beyond any pid
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def _sweep_stale(out: Path) -> None:
    """Temporaries of an earlier writer killed with SIGKILL: exactly the names
    :func:`_temp_sibling` makes (``.NAME.tmp-PID-TOKEN`` / ``.NAME.old-PID-TOKEN``) whose
    process is gone. Anything else beside ``out`` (a user's ``.NAME.old-backup/`` or
    ``.NAME.tmp-notes``) is never touched."""
    ours = re.compile(re.escape(f".{out.name}.") + r"(?:tmp|old)-([1-9][0-9]{0,9})-[0-9a-f]{8}\Z")
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        m = ours.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _remove(out.parent / name)


def _make_parents(out: Path) -> list[Path]:
    """Create the missing parent directories; return them (deepest last) for cleanup."""
    missing = [p for p in reversed(out.parent.parents) if not p.exists()]
    if not out.parent.exists():
        missing.append(out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LogitdiffError(f"{out}: cannot create its directory ({e.strerror})") from None
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            break


def _swap(tmp: Path, out: Path) -> None:
    if out.is_dir() and not out.is_symlink():
        old = _temp_sibling(out, "old")
        os.replace(out, old)
        os.replace(tmp, out)
        remove_tree(old)
    else:
        os.replace(tmp, out)  # a file, or nothing there: one atomic rename


@contextmanager
def writing(
    out: str | Path,
    kind: Kind,
    *,
    inputs: Sequence[str | Path] = (),
    overwrite: bool | None = None,
    resume: bool = False,
    in_place_when_new: bool = False,
) -> Iterator[Path]:
    """Guard, lock and yield the path to write ``out``'s new contents to.

    The yielded path is a fresh temporary sibling (a created directory for directory
    kinds, a file path for file kinds) that replaces ``out`` when the block succeeds, or
    ``out`` itself when resuming or (``in_place_when_new``) when ``out`` did not exist.
    On any exception the temporary is removed and ``out`` is left as it was; an output
    written in place is removed too, unless the exception is an interrupt (Ctrl-C,
    SIGTERM) or it is a RUN with finished chunks: a partial capture to ``--resume``."""
    out = Path(out)
    check_output(out, kind, inputs=inputs, overwrite=overwrite, resume=resume)
    created = _make_parents(out)
    try:
        with locked(out, made=created):
            # Again under the lock: another writer may have written it in the meantime.
            check_output(out, kind, inputs=inputs, overwrite=overwrite, resume=resume)
            _sweep_stale(out)
            existed = out.exists()
            if (resume and existed) or (in_place_when_new and not existed):
                try:
                    yield out
                except BaseException as e:
                    # A new output written in place goes again on an error, unless it is an
                    # interrupt or a RUN that already holds finished chunks (a server that died
                    # mid-capture): that partial run is what `capture --resume` continues.
                    if not existed and not isinstance(e, KeyboardInterrupt) and not _resumable(out, kind):
                        _remove(out)
                    raise
                return
            tmp = _temp_sibling(out, "tmp")
            try:
                if kind.is_dir:
                    tmp.mkdir()
                # the temporary's name is this call's alone: held without a lock file of its
                # own, so a RunWriter opened on it takes this lock instead of making one
                with _holding(held_key(tmp), tmp):
                    yield tmp
                _swap(tmp, out)
            except LogitdiffError as e:
                _remove(tmp)
                # the user never sees the temporary: name the output they asked for
                if str(tmp) in str(e):
                    raise LogitdiffError(str(e).replace(str(tmp), str(out))) from None
                raise
            except BaseException:
                _remove(tmp)
                raise
    except OSError as e:  # a write below that no layer named (a full disk): one line, naming out
        _remove_empty(created)
        raise write_error(out, e) from None
    except BaseException:
        _remove_empty(created)
        raise


def _resumable(out: Path, kind: Kind) -> bool:
    """A partial RUN with at least one finished chunk listed in its manifest."""
    if kind is not Kind.RUN:
        return False
    try:
        m = read_input_json(out / "manifest.json", inside=out)
    except LogitdiffError:
        return False
    return isinstance(m, dict) and m.get("status") == "partial" and bool(m.get("chunks"))


# --------------------------------------------------------------------------------------
# names of the reports `logitdiff run` writes
# --------------------------------------------------------------------------------------


def safe_name(spec: str) -> str:
    """A directory name for a candidate: ``builtin:tiny-Q4_K_M`` -> ``tiny-Q4_K_M``,
    ``gguf:/models/x-Q4_K_M.gguf`` -> ``x-Q4_K_M``, ``served:http://h:8000/v1,model=m`` (or ``openai:...``) -> ``h_8000_v1``."""
    kind, _, target = spec.split(",")[0].partition(":")
    if kind in ("gguf", "hf"):
        target = Path(target.rstrip("/")).name.removesuffix(".gguf")
    elif kind in ("served", "openai"):  # openai: the old name of served:
        target = target.split("//", 1)[-1]
    return _clean_name(target)


def _clean_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-80:] or "candidate"


REPORT_NAMES_HELP = (
    "each candidate's report is OUT/reports/NAME, NAME the spec's file name (gguf:a/model.gguf -> model); when "
    "candidates share a name, the parent directory is prefixed (a-model), and when that is shared too an 8-digit "
    "hash of the spec is appended (model-1a2b3c4d)"
)


def report_names(specs: list[str]) -> list[str]:
    """One unique report directory name per candidate; a name depends only on the spec
    and on which other candidates share its plain name (see ``REPORT_NAMES_HELP``)."""
    dup = sorted({s for s in specs if specs.count(s) > 1})
    if dup:
        raise LogitdiffError(f"--candidate {dup[0]!r} given twice: each candidate gets one report")
    plain = [safe_name(s) for s in specs]
    names = []
    for spec, name in zip(specs, plain):
        if plain.count(name) > 1:
            kind, _, target = spec.split(",")[0].partition(":")
            parent = Path(target.rstrip("/")).parent.name if kind in ("gguf", "hf") else ""
            name = _clean_name(f"{parent}-{name}") if parent else name
        names.append(name)
    # still shared (also when only the case differs: case-insensitive file systems)
    lower = [n.lower() for n in names]
    return [f"{n}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}" if lower.count(n.lower()) > 1 else n
            for spec, n in zip(specs, names)]
