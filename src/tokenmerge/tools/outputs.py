"""Output files that never overwrite what the user had, written atomically.

A command names its output files up front (``Outputs(folder, names)``) and calls ``check()`` before it runs:
a folder that is a file, a file in the way that this library did not write, a folder that cannot be created,
all stop it before any work is done, with a message that names the path and how to go on.

What is the user's and what is ours: every file a command writes is recorded, with its SHA-256, in
``MANIFEST`` inside the output folder. A file at an output path is ours, and is replaced on a rerun, only when
the record lists it with that very content; anything else (the user's file, a file of ours edited since, a
link, a folder) is never overwritten.

Writes go to a temporary file in the same folder and are moved into place with ``os.replace`` (atomic on one
file system), so an interrupted write never leaves a half file under an output's name. A file that appears in
the way while the command runs is left alone: the output goes beside it under a free name, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

from .text import quote

__all__ = ["MANIFEST", "OutputError", "Outputs", "atomic_write", "check_stem", "check_folder"]

MANIFEST = ".tokenmerge-outputs.json"
_STEM_CHARS = "letters, digits and . _ - +"
_STEM_MAX = 100


class OutputError(ValueError):
    """An output path that cannot be used; the message names it and says how to go on."""


def check_stem(stem: str) -> str:
    """``stem`` if it is a plain file name stem (no folder part), else ``ValueError`` saying what is allowed.

    Example:
        >>> check_stem("run-2")
        'run-2'
    """
    ok = (isinstance(stem, str) and 0 < len(stem) <= _STEM_MAX and stem.strip(".") != ""
          and all(c in "._-+" or (c.isalnum() and c.isprintable()) for c in stem))
    if not ok:
        raise ValueError(f"must be a plain file name stem: {_STEM_CHARS}, at most {_STEM_MAX} characters, not only "
                         f"dots, no folder part ('/' or '\\'): the files go into --out; got {quote(stem)}")
    return stem


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_folder(folder: Path, option: str = "--out") -> None:
    """``OutputError`` unless ``folder`` is a folder, or can be created as one (its existing part is a writable
    folder). Nothing is created."""
    try:
        path = Path(folder)
        for part in [path, *path.parents]:
            if part.is_symlink() and not part.is_dir() or part.exists() and not part.is_dir():
                where = "it is" if part == path else f"{quote(str(part))} is"
                raise OutputError(f"{option} {quote(str(folder))}: {where} a file, not a folder. Pass a folder for "
                                  f"{option} (it is created if missing); the file is left as it is")
            if part.is_dir():
                if not os.access(part, os.W_OK | os.X_OK):
                    raise OutputError(f"{option} {quote(str(folder))}: cannot write into {quote(str(part))} "
                                      f"(permission denied); pass another {option}")
                return
    except (OSError, ValueError) as err:
        if isinstance(err, OutputError):
            raise
        raise OutputError(f"{option} {quote(str(folder))}: not usable as a folder "
                          f"({getattr(err, 'strerror', None) or err}); pass another {option}") from None


def atomic_write(path: Path, write) -> Path:
    """``write(tmp)`` fills a temporary file beside ``path``, which then replaces ``path`` in one step; on any
    error (or an interrupt) the temporary file is removed and ``path`` is as it was. Returns ``path``.

    Example:
        >>> atomic_write(Path(tempfile.mkdtemp()) / "a.txt", lambda tmp: tmp.write_text("hi")).read_text()
        'hi'
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:50]}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


class Outputs:
    """The files one command writes into ``folder``: checked before it runs, written atomically after.

    Args:
        folder: the output folder (created when the first file is written).
        names: the file names the command may write (plain names, no folder part).
        option: the argument that chose the folder, for messages (``--out``).
        stem_option: the argument that chose the names, for messages (``--stem``), or None.

    Example:
        >>> out = Outputs(Path(tempfile.mkdtemp()) / "res", ["run.md"])
        >>> out.check()  # before the work: OutputError if a file is in the way
        >>> out.write_text("run.md", "# results").name
        'run.md'
    """

    def __init__(self, folder: Path, names: list[str], option: str = "--out", stem_option: str | None = "--stem"):
        self.folder = Path(folder)
        self.names = list(names)
        self.option = option
        self.stem_option = stem_option

    # ---- what is ours ------------------------------------------------------------------------------------------
    def _record(self) -> dict[str, str]:
        """Name -> SHA-256 of the files written here before; ``OutputError`` if the record is not ours."""
        path = self.folder / MANIFEST
        if not path.exists() and not path.is_symlink():
            return {}
        try:
            if path.is_symlink() or not path.is_file():
                raise ValueError("not a plain file")
            data = json.loads(path.read_text(encoding="utf-8"))
            files = data["files"]
            if data.get("written_by") != "tokenmerge" or not isinstance(files, dict):
                raise ValueError("not tokenmerge's record")
            return {str(k): str(v) for k, v in files.items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise OutputError(f"{path} is in the way: it is where tokenmerge records the files it wrote, but it is "
                              f"not such a record ({err}). Pass another {self.option}, or move it away") from None

    def _is_ours(self, name: str, record: dict[str, str]) -> bool:
        path = self.folder / name
        try:
            return name in record and not path.is_symlink() and path.is_file() and _hash(path) == record[name]
        except OSError:
            return False

    def _in_the_way(self, name: str, record: dict[str, str]) -> bool:
        path = self.folder / name
        try:
            there = path.exists() or path.is_symlink()
        except (OSError, ValueError):
            return True
        return there and not self._is_ours(name, record)

    def check(self) -> None:
        """``OutputError`` naming the first path that cannot be written without losing something."""
        check_folder(self.folder, self.option)
        if not self.folder.is_dir():
            return
        record = self._record()
        for name in self.names:
            if self._in_the_way(name, record):
                other = f"another {self.stem_option} or {self.option}" if self.stem_option else f"another {self.option}"
                raise OutputError(
                    f"{self.folder / name} already exists and is not an output tokenmerge wrote there (or it was "
                    f"changed since): it is never overwritten. Choose {other}, or move the file away")

    # ---- writing -----------------------------------------------------------------------------------------------
    def _target(self, name: str, record: dict[str, str]) -> Path:
        """Where ``name`` goes: its own path, or, if something appeared in the way meanwhile, a free one beside it."""
        if not self._in_the_way(name, record):
            return self.folder / name
        base = Path(name)
        for n in range(1, 10_000):
            alternative = f"{base.stem}.{n}{base.suffix}"
            if not self._in_the_way(alternative, record) and alternative not in record:
                warnings.warn(f"{self.folder / name} appeared while this command ran: it is left as it is, and "
                              f"this output is written to {self.folder / alternative}", stacklevel=3)
                return self.folder / alternative
        raise OutputError(f"no free name beside {self.folder / name}")

    def write(self, name: str, write) -> Path:
        """``write(path)`` fills a temporary file, which becomes the output ``name``; returns its final path."""
        if name not in self.names:
            raise ValueError(f"{name!r} is not one of this command's outputs {self.names}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            record = self._record()
        except (OSError, OutputError) as err:  # the folder went away or became unusable: keep the results anyway
            fallback = Path(tempfile.mkdtemp(prefix="tokenmerge-outputs-"))
            warnings.warn(f"cannot write into {self.folder} ({err}); the outputs go to {fallback} instead",
                          stacklevel=2)
            self.folder = fallback
            record = {}
        path = atomic_write(self._target(name, record), write)
        record[path.name] = _hash(path)
        manifest = json.dumps({"written_by": "tokenmerge", "files": record}, indent=1, sort_keys=True) + "\n"
        atomic_write(self.folder / MANIFEST, lambda tmp: tmp.write_text(manifest, encoding="utf-8"))
        return path

    def write_text(self, name: str, text: str) -> Path:
        return self.write(name, lambda tmp: tmp.write_text(text, encoding="utf-8"))
