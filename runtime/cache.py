"""The compilation cache: generated kernels and their contract, keyed by what produced them.

The key is a SHA-256 over the elaborated spec (``spec_to_json``), the codegen options, the
rdepc, torch and triton versions (and a digest of the generator's own source), the target
(the backend) and whether the kernels run under the interpreter. An entry is a directory
``KEY[:2]/KEY`` holding ``kernels.py``, ``contract.json`` and a ``complete`` marker: JSON with
the key and the SHA-256 of every other file. It is built in a scratch directory beside it
(marker last) and renamed into place, so a reader never sees half an entry.

Every read verifies the entry against its marker. One that fails (a file changed, truncated
or missing, a garbled marker, an older rdepc's marker without digests, something that is
not a directory) is replaced by a fresh build, with one ``rdepc: warning: cache entry ...
was damaged (...); rebuilt`` line on stderr. Replacing takes a lock on the shard directory
(``flock``) and checks again under it, so processes that find the same damaged entry at
once rebuild it once and never move aside an entry another has just installed.

The directory is ``$RDEPC_CACHE_DIR``, default ``~/.cache/rdepc``; one that cannot be
created or written raises :class:`CacheError` (a ``UsageError``) before anything is
compiled. :func:`info` and :func:`clear` back ``rdepc cache info|clear``; they touch only
entries (and scratch directories of interrupted builds), never other files there (such as
``tuning/``, :mod:`rdepc.runtime.tune`'s records).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from rdepc.diagnostics import Diagnostic, Severity, UsageError
from rdepc.version import __version__


class CacheError(UsageError):
    """The cache directory cannot be used: one line naming it, the variable that chose it and
    what to do."""


def cache_dir() -> Path:
    if os.environ.get("RDEPC_CACHE_DIR"):
        return Path(os.environ["RDEPC_CACHE_DIR"])
    try:
        return Path.home() / ".cache" / "rdepc"
    except RuntimeError:  # no HOME and no password entry to fall back on
        raise CacheError(
            "cannot find a home directory for the compilation cache (HOME is unset); "
            "set RDEPC_CACHE_DIR to a writable directory"
        ) from None


def _unusable(path: Path, e: OSError) -> CacheError:
    """Why ``path`` (in the cache) could not be made or written, as :class:`CacheError`."""
    near = path
    while not near.exists() and near.parent != near:  # the deepest part that is there
        near = near.parent
    if near.exists() and not near.is_dir():
        why = f"{near} is a file, not a directory"
    elif near.exists() and not os.access(near, os.W_OK | os.X_OK):
        why = f"{near} is not writable"
    else:
        why = f"{e.filename or path}: {e.strerror or e}"
    if os.environ.get("RDEPC_CACHE_DIR"):
        where = f"RDEPC_CACHE_DIR={os.environ['RDEPC_CACHE_DIR']}"
        fix = "set RDEPC_CACHE_DIR to a writable directory"
    else:
        where = f"{cache_dir()} (RDEPC_CACHE_DIR is unset: the default under HOME={Path.home()})"
        fix = "set RDEPC_CACHE_DIR to a writable directory, or point HOME at a writable directory"
    return CacheError(f"cannot use the compilation cache {where}: {why}; {fix}")


def usable_cache_dir() -> Path:
    """:func:`cache_dir`, created if need be; raises :class:`CacheError` (one line) when it
    cannot be created or written, before anything is compiled into it."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable(d, e) from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise _unusable(d, PermissionError(13, "Permission denied", str(d)))
    return d


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_key(spec_json: dict, options: dict, target: str, interpret: bool, generator: str) -> str:
    """The entry key; ``generator`` is a digest of the code generator's source."""
    data = {
        "spec": spec_json,
        "options": options,
        "rdepc": __version__,
        "generator": generator,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "target": target,
        "interpret": interpret,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -- entries ---------------------------------------------------------------------------------

MARKER = "complete"
_KEY = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_SCRATCH = re.compile(r"\.([0-9a-f]{64})\.[0-9]+\.[0-9a-f]+\.(tmp|old)")  # an entry being built, or moved aside
_STALE_S = 600  # a scratch directory untouched this long belongs to no running build
_OLD_FORMAT = "written by an older rdepc (its complete marker has no file digests)"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _marker(key: str, files: dict[str, bytes]) -> str:
    digests = {name: _sha256(data) for name, data in sorted(files.items())}
    return json.dumps({"key": key, "files": digests}, indent=1) + "\n"


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", MARKER) and "/" not in name and "\\" not in name


def _problem(d: Path, key: str, required: Iterable[str] = ()) -> str | None:
    """What is wrong with the entry at ``d`` (which exists), in words; None when every file
    its marker lists is there with the digest recorded."""
    if d.is_symlink():
        return "it is a symbolic link, not a directory"
    if not d.is_dir():
        return "it is not a directory"
    try:
        raw = (d / MARKER).read_bytes()
    except FileNotFoundError:
        return f"it has no {MARKER} marker"
    except OSError as e:
        return f"its {MARKER} marker cannot be read: {e.strerror or e}"
    if _KEY.fullmatch(raw.decode("ascii", "replace").strip()):  # before JSON: a hex key may parse as a number
        return _OLD_FORMAT
    try:
        marker = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        marker = None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not (
        isinstance(files, dict)
        and all(_plain_name(n) and isinstance(h, str) and _KEY.fullmatch(h) for n, h in files.items())
        and set(required) <= set(files)
    ):
        return f"its {MARKER} marker is garbled"
    if marker.get("key") != key:
        return f"its {MARKER} marker belongs to another entry"
    for name, digest in files.items():
        try:
            data = (d / name).read_bytes()
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read: {e.strerror or e}"
        if _sha256(data) != digest:
            return f"{name} does not match its digest"
    return None


def _what_was_wrong(d: Path, problem: str) -> str:
    return f"cache entry {d} was {problem if problem == _OLD_FORMAT else f'damaged ({problem})'}"


def _warn(message: str) -> None:
    """One ``rdepc: warning: ...`` line on stderr, as the command line prints diagnostics."""
    color = getattr(sys.stderr, "isatty", lambda: False)() and os.environ.get("NO_COLOR") is None
    print(Diagnostic(Severity.WARNING, message).render(color=color), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Processes (and threads) replacing entries of one shard directory take turns, so that
    none moves aside an entry another has just installed and may be reading."""
    try:
        import fcntl
    except ImportError:  # no flock: the rename in entry() still tolerates a lost race
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _scratch(shard: Path, key: str, kind: str) -> Path:
    return shard / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{kind}"


def _remove(path: Path) -> None:
    """Remove an entry (or scratch directory): a directory is first moved aside, so that no
    reader finds half of it under its name."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    aside = path
    if not path.name.startswith("."):
        aside = _scratch(path.parent, path.name, "old")
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # someone else removed it first
            return

    shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):  # gone: removed by another process too
        if os.path.lexists(aside):
            shutil.rmtree(aside)  # what stopped the first pass, as an OSError


def entry(key: str, build: Callable[[], Mapping[str, str | bytes]], required: Iterable[str] = ()) -> tuple[Path, bool]:
    """The cache directory of ``key``, built by ``build()`` (file name → text or bytes) when
    it is absent or fails verification (``required``: file names it must hold). Returns
    (directory, hit). A damaged entry is replaced, with one warning line on stderr."""
    d = cache_dir() / key[:2] / key
    required = tuple(required)
    try:
        problem = _problem(d, key, required) if os.path.lexists(d) else ""  # "": no entry
    except OSError as e:
        raise _unusable(d, e) from None
    if problem is None:  # a read-only cache still serves what it holds
        return d, True
    usable_cache_dir()
    shard = d.parent
    try:
        shard.mkdir(exist_ok=True)  # before building: an unusable cache fails fast
    except OSError as e:
        raise _unusable(shard, e) from None
    files = {name: text.encode("utf-8") if isinstance(text, str) else bytes(text) for name, text in build().items()}
    if not all(_plain_name(n) for n in files) or not set(required) <= set(files):
        raise ValueError(f"cache entry files {sorted(files)}: expected plain file names including {list(required)}")
    tmp = _scratch(shard, key, "tmp")
    try:
        tmp.mkdir()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / MARKER).write_text(_marker(key, files), encoding="utf-8")  # last
        with _locked(shard):
            problem = _problem(d, key, required) if os.path.lexists(d) else ""
            if problem is None:  # another process installed it while this one built
                return d, False
            if problem:
                _remove(d)
                _warn(f"{_what_was_wrong(d, problem)}; rebuilt")
            try:
                os.rename(tmp, d)
            except OSError as e:  # lost a race to a process that did not take the lock
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or _problem(d, key, required) is not None:
                    raise
    except OSError as e:  # a full disk, or the directory changed under us
        raise _unusable(d, e) from None
    finally:
        if os.path.lexists(tmp):
            with contextlib.suppress(OSError):
                _remove(tmp)
    return d, False


# -- rdepc cache info | clear ----------------------------------------------------------------


@dataclass
class CacheInfo:
    """What ``rdepc cache info`` prints: where the cache is and why, its entries, their size
    and those that fail verification (path, what is wrong)."""

    directory: Path
    chosen_by: str
    exists: bool
    entries: int = 0
    size: int = 0
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    tuning_records: int = 0


def chosen_by() -> str:
    """How :func:`cache_dir` was chosen, in words."""
    if os.environ.get("RDEPC_CACHE_DIR"):
        return "RDEPC_CACHE_DIR"
    return f"the default under HOME={Path.home()}; RDEPC_CACHE_DIR is unset"


def _existing_cache_dir() -> Path | None:
    """:func:`cache_dir` when it is a directory this process can list, None when it does
    not exist (yet); :class:`CacheError` when it cannot be a cache (a file, no permission)."""
    d = cache_dir()
    try:
        if not os.path.lexists(d):
            near = d.parent
            while not os.path.lexists(near) and near.parent != near:
                near = near.parent
            if near.is_dir():
                return None
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        if not d.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        os.listdir(d)
    except OSError as e:
        raise _unusable(d, e) from None
    return d


def _entries(root: Path) -> Iterator[tuple[Path, str | None]]:
    """The entries under ``root`` (``XX/KEY``, ``KEY`` a SHA-256 starting with ``XX``) and
    rdepc's own scratch directories (key None); nothing else in the directory."""
    for shard in sorted(root.iterdir()):
        if not _SHARD.fullmatch(shard.name) or shard.is_symlink() or not shard.is_dir():
            continue
        for path in sorted(shard.iterdir()):
            if _KEY.fullmatch(path.name) and path.name.startswith(shard.name):
                yield path, path.name
            else:
                m = _SCRATCH.fullmatch(path.name)
                if m and m.group(1).startswith(shard.name) and not path.is_symlink() and path.is_dir():
                    yield path, None


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def info() -> CacheInfo:
    """The cache as it is now: its entries, their size, which fail verification."""
    root = _existing_cache_dir()
    result = CacheInfo(cache_dir(), chosen_by(), root is not None)
    if root is None:
        return result
    try:
        for path, key in _entries(root):
            if key is None:
                continue
            result.entries += 1
            result.size += _size(path)
            problem = _problem(path, key)
            if problem is not None:
                result.damaged.append((path, problem))
        tuning = root / "tuning"
        if tuning.is_dir():
            result.tuning_records = sum(1 for p in tuning.glob("*.json") if p.is_file())
    except OSError as e:
        raise _unusable(root, e) from None
    return result


def clear() -> tuple[int, int]:
    """Remove every entry of the cache (and scratch left by builds that were interrupted);
    nothing else there. Returns (entries removed, bytes freed)."""
    root = _existing_cache_dir()
    if root is None:
        return 0, 0
    if not os.access(root, os.W_OK | os.X_OK):
        raise _unusable(root, PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root)))
    removed = freed = 0
    shards = set()
    try:
        for path, key in list(_entries(root)):
            if key is None and time.time() - path.lstat().st_mtime < _STALE_S:
                continue  # a build in progress, about to move it into place
            size = _size(path)
            _remove(path)
            removed += key is not None
            freed += size
            shards.add(path.parent)
        for shard in shards:
            with contextlib.suppress(OSError):  # not empty: something else is in it
                shard.rmdir()
    except OSError as e:
        raise _unusable(root, e) from None
    return removed, freed


def human_size(n: int) -> str:
    """Bytes in binary units: 512 B, 3.4 KiB, 1.2 MiB, 2.0 GiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


__all__ = [
    "CacheError",
    "CacheInfo",
    "cache_dir",
    "cache_key",
    "chosen_by",
    "clear",
    "entry",
    "human_size",
    "info",
    "usable_cache_dir",
    "write_atomic",
]
