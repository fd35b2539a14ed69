"""The on-disk cache of preparations: a directory of keyed entries (``TORCHDI_CACHE_DIR``).

What it stores (DESIGN, "Persisted preparations"): ``AutoSparse``'s detected patterns and
colourings, and ``AutoCompile``'s compiled artifacts (torch's Mega-Cache). Each entry is one
file::

    TORCHDI-CACHE\\n
    {"format": 1, "torch": ..., "torchdi": ..., "kind": ..., "key": ..., "size": ..., "sha256": ...}\\n
    <payload bytes>

An entry is served only when its magic line, format version, torch version, torchdi version,
full key, size and SHA-256 checksum all match: a corrupt, truncated or foreign entry (another
torch, another torchdi, a hash collision of file names) is ignored, with one debug line on the
``torchdi`` logger, and the caller prepares from scratch. Writes go to a temporary file in the
same directory and are renamed into place (``os.replace``, atomic), so a reader sees a whole old
entry or a whole new one, and two processes writing the same entry both succeed (the last one
wins; their contents are equal). A read-only, missing or full directory makes writes no-ops.
Nothing here ever raises to a caller.

The directory is bounded (``TORCHDI_CACHE_MAX_BYTES``, default 1 GiB): after a write, the least
recently used entries (reads touch an entry's mtime) are removed until the total fits.

Where: ``TORCHDI_CACHE_DIR`` when set (``""`` turns the cache off), else ``$XDG_CACHE_HOME/torchdi``
(``~/.cache/torchdi``). ``python -m torchdi cache info`` / ``python -m torchdi cache clear``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchdi.fingerprint import source_digest

__all__ = ["CacheInfo", "FORMAT", "Store", "cache_directory", "store_for"]

logger = logging.getLogger("torchdi")

#: The entry layout's version: entries written with another one are ignored.
FORMAT = 1
MAGIC = b"TORCHDI-CACHE\n"
SUFFIX = ".entry"
DEFAULT_MAX_BYTES = 1 << 30
# Unset: the default directory. Set to "": no cache. Anything else: that directory.
ENV_DIR = "TORCHDI_CACHE_DIR"
ENV_MAX_BYTES = "TORCHDI_CACHE_MAX_BYTES"


def _torchdi_version() -> str:
    # The package's __init__ has run before any of its submodules is used.
    # The source digest: a development tree's entries never meet another tree's of one version.
    return f'{getattr(sys.modules.get("torchdi"), "__version__", "unknown")}+{source_digest()}'


def cache_directory(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The cache directory in effect: ``explicit``, else ``TORCHDI_CACHE_DIR``, else the default.

    Args:
        explicit: a directory given by the caller (``AutoCompile(cache_dir=...)``); ``""`` turns
            the cache off; ``None`` defers to the environment.

    Returns:
        The directory (not created here), or ``None`` when the cache is off.

    Example::

        >>> cache_directory("") is None
        True
        >>> cache_directory("/tmp/mine")
        PosixPath('/tmp/mine')
    """
    if explicit is None:
        explicit = os.environ.get(ENV_DIR)
    if explicit is not None:
        text = os.fspath(explicit)
        return Path(text).expanduser() if text else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchdi"


def _max_bytes() -> int:
    text = os.environ.get(ENV_MAX_BYTES, "")
    try:
        return int(text) if text else DEFAULT_MAX_BYTES
    except ValueError:
        logger.debug("torchdi cache: %s=%r is not an integer; using %d", ENV_MAX_BYTES, text, DEFAULT_MAX_BYTES)
        return DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class CacheInfo:
    """What ``python -m torchdi cache info`` prints: the directory, its entries and their size."""

    directory: Path | None
    entries: int
    bytes: int
    max_bytes: int
    by_kind: dict[str, int]


class Store:
    """A directory of keyed entries (see the module docstring for the format and guarantees).

    Args:
        directory: where the entries live (created on the first write).
        max_bytes: the size bound; least recently used entries are evicted beyond it.

    Example::

        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> store.put("demo", "k", b"payload")
        True
        >>> store.get("demo", "k")
        b'payload'
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = _max_bytes() if max_bytes is None else int(max_bytes)

    def path(self, kind: str, key: str) -> Path:
        """The file of entry ``(kind, key)`` (its name is a hash of both)."""
        digest = hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:40]
        return self.directory / f"{kind}-{digest}{SUFFIX}"

    def _header(self, kind: str, key: str, payload: bytes) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "torch": torch.__version__,
            "torchdi": _torchdi_version(),
            "kind": kind,
            "key": key,
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }

    def get(self, kind: str, key: str) -> bytes | None:
        """The payload stored under ``(kind, key)``, or ``None`` (absent, unreadable, corrupt,
        truncated or foreign: each logged at debug level)."""
        path = self.path(kind, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.debug("torchdi cache: cannot read %s (%s); preparing from scratch", path, error)
            return None
        payload = self._validate(path, data, kind, key)
        if payload is not None:
            with contextlib.suppress(OSError):  # least recently used: a read counts as a use
                os.utime(path)
        return payload

    def _validate(self, path: Path, data: bytes, kind: str, key: str) -> bytes | None:
        def reject(why: str) -> None:
            logger.debug("torchdi cache: ignoring %s (%s); preparing from scratch", path, why)

        if not data.startswith(MAGIC):
            reject("not a torchdi cache entry")
            return None
        end = data.find(b"\n", len(MAGIC))
        if end < 0:
            reject("truncated header")
            return None
        try:
            header = json.loads(data[len(MAGIC) : end])
        except ValueError:
            reject("unreadable header")
            return None
        if not isinstance(header, dict):
            reject("unreadable header")
            return None
        expected = self._header(kind, key, b"")
        for field in ("format", "torch", "torchdi", "kind", "key"):
            if header.get(field) != expected[field]:
                reject(f"written for {field}={header.get(field)!r}, this is {expected[field]!r}")
                return None
        payload = data[end + 1 :]
        if header.get("size") != len(payload):
            reject(f"truncated: {len(payload)} of {header.get('size')} bytes")
            return None
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            reject("checksum mismatch")
            return None
        return payload

    def put(self, kind: str, key: str, payload: bytes) -> bool:
        """Store ``payload`` under ``(kind, key)`` atomically; ``False`` when it could not be
        written (read-only or full directory: logged at debug level, never raised)."""
        path = self.path(kind, key)
        header = json.dumps(self._header(kind, key, payload), sort_keys=True).encode()
        temporary = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(descriptor, "wb") as file:
                file.write(MAGIC + header + b"\n" + payload)
            os.replace(temporary, path)
            temporary = None
        except OSError as error:
            logger.debug("torchdi cache: cannot write %s (%s); the preparation is not persisted", path, error)
            return False
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
        self.evict()
        return True

    def _entries(self) -> list[tuple[float, int, Path]]:
        found = []
        try:
            with os.scandir(self.directory) as listing:
                for item in listing:
                    if item.name.endswith(SUFFIX) and not item.name.startswith("."):
                        try:
                            stat = item.stat()
                        except OSError:
                            continue
                        found.append((stat.st_mtime, stat.st_size, Path(item.path)))
        except OSError:
            return []
        return found

    def evict(self) -> int:
        """Remove least recently used entries until the directory fits ``max_bytes``; stale
        temporary files (a writer that died) older than an hour go too. Returns entries removed."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
                removed += 1
                total -= size
                logger.debug("torchdi cache: evicted %s (least recently used)", path)
            except OSError:
                pass
        try:
            cutoff = time.time() - 3600
            for item in self.directory.glob(".*.tmp"):
                if item.stat().st_mtime < cutoff:
                    item.unlink()
        except OSError:
            pass
        return removed

    def info(self) -> CacheInfo:
        """The directory's entries: count, bytes, count by kind."""
        entries = self._entries()
        by_kind: dict[str, int] = {}
        for _, _, path in entries:
            kind = path.name.rsplit("-", 1)[0]
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return CacheInfo(self.directory, len(entries), sum(size for _, size, _ in entries), self.max_bytes, by_kind)

    def clear(self) -> int:
        """Remove every entry (and temporary file); returns the number of entries removed."""
        removed = 0
        for _, _, path in self._entries():
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
        try:
            for item in self.directory.glob(".*.tmp"):
                item.unlink()
        except OSError:
            pass
        return removed


def store_for(explicit: str | os.PathLike[str] | None = None) -> Store | None:
    """The store in effect (``cache_directory(explicit)``), or ``None`` when the cache is off."""
    directory = cache_directory(explicit)
    return None if directory is None else Store(directory)
