"""A run's JAX compilation cache: a resumed run loads its compiled programs instead of compiling them again.

Scope: one JAX persistent compilation cache kept in a folder of the run (``<run>/compile_cache/``, or any
location ``fc.use_compilation_cache`` is given: a local folder, ``s3://``, ``gs://``), written through
the run's own storage. Each entry is checked: it is JAX's entry behind a header with its key, its length
and the crc32c of both, so a damaged or half-written entry, or one stored under another key, is ignored
(one log line, and compiled again), never handed to XLA; a load costs one comparison of the key (at most
200 bytes) beyond the crc32c. Entries sit in a folder per JAX version, jaxlib version and device kind
(``<jax>-<jaxlib>-<platform>-<device kind>``), so a program never loads what another version compiled;
the writer removes other versions' entries. The whole cache holds at most ``max_bytes``: when full,
entries this process neither read nor wrote are removed first, and a program that still does not fit is
not written. JAX writes entries from process 0 alone; every process reads. Which folder is the cache's,
what in it the cache may delete, and who may write there: cache_folder.py (a folder holding anything
the cache did not write is not used).

What does not belong here: when to compile (JAX), the checkpoints themselves (manager/), the
callback's default (callbacks/).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from typing import Any

from flax_ckpt._src import cache_folder
from flax_ckpt._src.errors import CorruptCheckpointError
from flax_ckpt._src.storage import Storage, open_storage

log = logging.getLogger("flax_ckpt")

FOLDER = (
    "compile_cache"  # the cache's folder in a run directory (no step folder's name: no digits at its end)
)
DEFAULT_MAX_BYTES = 2 << 30
_MAGIC = b"FCJXC\x00\x00\x02"
_HEADER = struct.Struct("<8sQIH")  # magic, payload length, crc32c of key and payload, key length; the key
_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,200}")  # JAX's keys: '<module name>-<sha256 hex>'


@dataclass(frozen=True)
class CompilationCacheInfo:
    """What a run's compilation cache holds.

    Attributes:
      location: the cache's folder for this JAX version and device kind.
      entries: compiled programs stored there.
      nbytes: their bytes.
      max_bytes: the bound on the whole cache.
      hits: programs this process loaded from it instead of compiling.
      misses: programs this process looked for and did not find (or found damaged).
      writes: programs this process stored in it.
    """

    location: str
    entries: int
    nbytes: int
    max_bytes: int
    hits: int
    misses: int
    writes: int


def _crc(data: Any, start: int = 0) -> int:
    import crc32c

    return crc32c.crc32c(data, start)


def namespace() -> str:
    """The folder of the running JAX: its version, jaxlib's, the platform and device kind; a program
    compiled by another of any of these is never loaded."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    kind = dev.platform if dev.device_kind.lower() == dev.platform else f"{dev.platform}-{dev.device_kind}"
    kind = re.sub(r"[^A-Za-z0-9_.\-]+", "_", kind).strip("_")
    return f"jax{jax.__version__}-jaxlib{getattr(jaxlib, '__version__', 'unknown')}-{kind}"


class CompilationCache:
    """A run's compilation cache, as ``fc.use_compilation_cache`` installs it: JAX's cache interface
    (``get``/``put``, called while compiling, from any thread) over a folder, with checked entries and a
    size bound. ``info()`` says what it holds."""

    def __init__(self, root: Storage, max_bytes: int):
        self.root = root
        self.max_bytes = max_bytes
        self._path = root.url  # JAX's interface names the cache's location
        self._lock = threading.Lock()
        self._folder: Storage | None = (
            None  # the namespace's folder, known at the first call (the backend is up)
        )
        self._root: cache_folder.Root | None = None  # the marked root, as listed then
        self._names: dict[str, str] = {}  # key -> entry name
        self._sizes: dict[str, int] = {}  # entry name -> bytes
        self._used: set[str] = set()  # keys this process read or wrote
        self._said: set[str] = set()  # the log lines said (one each)
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.broken = False

    # -------------------------------------------------------------------------------- JAX's interface

    def get(self, key: str) -> bytes | None:
        """The entry of ``key``, checked; None for a miss or an entry that fails its check."""
        try:
            with self._lock:
                folder = self._open()
                name = self._names.get(key) if folder is not None and _KEY.fullmatch(key) else None
                if folder is not None and name is None:
                    self.misses += 1
            if folder is None or name is None:
                return None
            try:
                payload = _unwrap(folder.read(name, self._sizes[name]), key)
            except CorruptCheckpointError:  # larger than its name says, or not a regular file
                payload = None
            if payload is None:
                self._say(
                    "damaged",
                    f"compilation cache: {folder.url}/{name} is damaged or not this program's; compiling it again",
                )
                self._forget(key, name, delete=True)
                with self._lock:
                    self.misses += 1
                return None
            with self._lock:
                self._used.add(key)
                self.hits += 1
            return payload
        except FileNotFoundError:
            with self._lock:
                self._names.pop(key, None)
            return None
        except Exception as e:  # a cache never stops training: one line, then compile
            self._say("read", f"compilation cache at {self.root.url} cannot be read ({e}); compiling instead")
            return None

    def put(self, key: str, value: bytes) -> None:
        """Stores ``value`` as ``key``'s entry, unless it would take the cache past its bound."""
        if not _KEY.fullmatch(key):
            return
        try:
            with self._lock:
                folder = self._open()
                if folder is None or self._root is None or self._root.id is None:
                    return
                size = _HEADER.size + len(key) + len(value)
                if not self._room(folder, size):
                    self._say(
                        "full",
                        f"compilation cache at {folder.url} is full ({self.max_bytes} bytes, max_bytes); "
                        f"{key} is not stored",
                    )
                    return
                name = self._root.entry_name(key, size)
                old = self._names.get(key)
                self._write(folder, name, key, value)
                self._names[key], self._sizes[name] = name, size
                self._used.add(key)
                self.writes += 1
            if old is not None and old != name:
                self._forget(key, old, delete=True, keep=name)
        except Exception as e:
            self._say("write", f"compilation cache at {self.root.url} cannot be written ({e}); not stored")

    def clear(self) -> None:  # JAX's interface; the cache is cleared by deleting its folder
        with self._lock:
            self._used.clear()

    def close(self) -> None:
        """Stops using this cache: programs compiled from now on are not stored (and the folder is not
        created again once its run is deleted). ``CheckpointCallback.close`` calls it."""
        global _installed
        cc = _jax_cache()
        with _install_lock:
            if _installed is not self:
                return
            _installed = None
            cc.reset_cache()

    # -------------------------------------------------------------------------------- the folder

    def info(self) -> CompilationCacheInfo:
        """What the cache holds now (for this JAX version and device kind)."""
        with self._lock:
            folder = self._open()
            url = folder.url if folder is not None else self.root.url
            sizes = dict(self._sizes)
        return CompilationCacheInfo(
            url, len(sizes), sum(sizes.values()), self.max_bytes, self.hits, self.misses, self.writes
        )

    def _open(self) -> Storage | None:
        """The namespace's folder, listed once (under the lock); None once the cache is found unusable."""
        if self._folder is not None or self.broken:
            return self._folder
        try:
            ns, writer = namespace(), _writer()
            root = cache_folder.open_root(self.root, writer=writer)
            folder = cache_folder.namespace_folder(root, ns, writer=writer)
            for name, size in root.entries.get(ns, {}).items():
                self._names[cache_folder.key_of(name)] = name
                self._sizes[name] = size
            self._folder, self._root = folder, root
            if writer:
                cache_folder.tidy(root, keep=ns)  # other versions' entries, temporaries of dead writes
            n = len(self._names)
            log.log(
                logging.INFO if n else logging.DEBUG, "compilation cache: %s holds %d programs", folder.url, n
            )
        except Exception as e:
            self.broken = True
            self._say("open", f"compilation cache at {self.root.url} is not used ({e}); compiling without it")
        return self._folder

    def _room(self, folder: Storage, size: int) -> bool:
        """Whether ``size`` more bytes fit under max_bytes, after removing entries this process has not
        used (oldest names first) where they do not."""
        if size > self.max_bytes:
            return False
        total = sum(self._sizes.values())
        for key, name in sorted(self._names.items()):
            if total + size <= self.max_bytes:
                break
            if key not in self._used:
                folder.delete(name)
                del self._names[key]
                total -= self._sizes.pop(name)
        return total + size <= self.max_bytes

    def _write(self, folder: Storage, name: str, key: str, value: bytes) -> None:
        k = key.encode()
        head = _HEADER.pack(_MAGIC, len(value), _crc(value, _crc(k)), len(k)) + k
        if not folder.supports_rename:  # an object store's object appears whole
            folder.write(name, [head, value])
            return
        assert self._root is not None
        tmp = self._root.tmp_name()  # readers in other processes never see a part of the entry
        try:
            folder.write(tmp, [head, value])
            folder.rename(tmp, name)
        except BaseException:  # a full disk: nothing of it stays
            try:
                folder.delete(tmp)
            except OSError:
                pass
            raise

    def _forget(self, key: str, name: str, *, delete: bool, keep: str | None = None) -> None:
        with self._lock:
            if self._names.get(key) == name:
                del self._names[key]
            self._sizes.pop(name, None)
            folder = self._folder
        if delete and folder is not None and name != keep and _writer():
            try:
                folder.delete(name)
            except OSError:
                pass

    def _say(self, what: str, line: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(line)


def summary(run: Storage) -> tuple[int, int, list[str]] | None:
    """(programs, bytes, the JAX versions and device kinds they are for) of a run directory's cache, or
    None where it has none. Reads names alone (an entry's name holds its size)."""
    root = run.sub(FOLDER)
    if root.kind() != "folder":
        return None
    count = nbytes = 0
    kinds = []
    for ns in root.list():
        names = root.sub(ns).list() if cache_folder.NAMESPACE.fullmatch(ns) else []
        sizes = [int(m["n"]) for m in map(cache_folder.ENTRY.fullmatch, names) if m is not None]
        if sizes:
            kinds.append(ns)
            count, nbytes = count + len(sizes), nbytes + sum(sizes)
    return count, nbytes, kinds


def _unwrap(data: bytes, key: str) -> bytes | None:
    """The payload of a stored entry, or None when its header, key, length or crc32c do not hold: an
    entry stored under another key (moved, swapped) is never handed to XLA for this one."""
    k = key.encode()
    if len(data) < _HEADER.size:
        return None
    magic, n, crc, nk = _HEADER.unpack_from(data)
    start = _HEADER.size + nk
    if magic != _MAGIC or nk != len(k) or n != len(data) - start or data[_HEADER.size : start] != k:
        return None
    payload = memoryview(data)[start:]
    if _crc(payload, _crc(k)) != crc:
        return None
    return bytes(payload)


def _writer() -> bool:
    """Whether this process writes the cache (JAX stores entries from process 0 alone)."""
    import jax

    return jax.process_index() == 0


_installed: CompilationCache | None = None
_install_lock = threading.Lock()


def _jax_cache() -> Any:
    """JAX's compilation-cache module: the one place of this module that touches JAX's private API (JAX
    has no public way to install a cache of one's own; its globals are set under its own lock)."""
    import importlib

    return importlib.import_module("jax._src.compilation_cache")


def _after_fork_in_child() -> None:
    """A forked child starts with its own locks: one a parent's thread held at the fork (a compile in
    flight) would never be released in the child."""
    global _install_lock
    _install_lock = threading.Lock()
    if _installed is not None:
        _installed._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def use_compilation_cache(
    location: Any,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    options: Any = None,
) -> CompilationCache | None:
    """Keeps JAX's compiled programs in ``location``, so that a restarted program loads them instead of
    compiling them again (the first step after a preemption then costs a load, not a compile).

    ``CheckpointCallback`` calls this with ``<directory>/compile_cache`` unless given
    ``compile_cache=False``; manager users call it themselves, once, before the first step compiles.
    A compilation cache the program configured itself (``jax_compilation_cache_dir``, or
    ``JAX_COMPILATION_CACHE_DIR``) is left as it is, and so is ``jax_enable_compilation_cache=False``:
    this returns None then. A cache that cannot be read or written, or an entry that is damaged, is
    ignored with one log line and the program is compiled as it would be without one.

    The cache's folder holds the cache alone: flax_ckpt creates it (mode 0700 on a local disk) and marks
    it as the cache's, and deletes nothing there but entries it wrote. A folder that holds anything else
    (a run directory, a user's files), or one another user owns or could write (entries are code that
    JAX runs), or a symbolic link, is not used: one log line, and programs compile as without a cache.

    Args:
      location: a folder of its own, missing or empty at first (a path, ``s3://bucket/prefix`` or
        ``gs://bucket/prefix``); a run directory's cache is ``<run>/compile_cache``.
      max_bytes: the most the cache holds, across JAX versions and device kinds.
      options: how to reach an object store (``fc.ObjectStoreOptions`` or a dict), as the manager's.

    Returns:
      The cache now in use (``.info()`` says what it holds), or None when the program's own cache
      setting stands.

    Raises:
      ValueError: ``max_bytes`` is not a positive integer.

    Example::

        mgr = fc.CheckpointManager(run)
        fc.use_compilation_cache(f"{run}/compile_cache")
        state = mgr.restore(target=state)  # then the first step loads its program
    """
    if type(max_bytes) is not int or max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r}: give a positive number of bytes")
    import jax

    try:
        cc = _jax_cache()
    except ImportError:  # pragma: no cover - a JAX without the module
        log.warning("compilation cache: this JAX (%s) has none to set; compiling as usual", jax.__version__)
        return None
    with _install_lock:
        return _install(jax, cc, location, max_bytes, options)


def _install(jax: Any, cc: Any, location: Any, max_bytes: int, options: Any) -> CompilationCache | None:
    global _installed
    configured = getattr(jax.config, "jax_compilation_cache_dir", None)
    if not getattr(jax.config, "jax_enable_compilation_cache", True):
        return None
    if configured:
        log.info("compilation cache: the program's own (%s) is used", configured)
        return None
    try:
        root = open_storage(location, options=options)
        cache = CompilationCache(root, max_bytes)
        with cc._cache_initialized_mutex:
            if cc._cache is not None and cc._cache is not _installed:  # JAX set one up itself: leave it
                return None
            cc._cache = cache
            cc._cache_initialized = True
            cc._cache_checked = False
        # jax_compilation_cache_dir stays unset: JAX derives XLA's own cache folders from it and puts
        # their paths into every program's key, so a run moved elsewhere would find none of its programs
    except Exception as e:
        log.warning("compilation cache at %s is not used (%s)", location, e)
        return None
    _installed = cache
    return cache
