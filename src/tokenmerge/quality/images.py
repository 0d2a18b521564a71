"""The image cache of ``quality`` and ``demo``: per key (model, method, prompt, seed, settings), a PNG and a JSON
record (the seconds it took, the device, the process).

Each file is written atomically (a temporary file beside it, then ``os.replace``), the record last: an entry
whose record is there is whole, and an interrupted write leaves at worst an image without its record, which is
generated again. A damaged entry (an image that does not decode, a record that does not parse) is generated
again with a ``CacheWarning`` naming the file. Everything in the cache is this library's own, regenerable output.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from ..tools.outputs import atomic_write

__all__ = ["CacheWarning", "ImageCache"]


class CacheWarning(UserWarning):
    """A cached entry was damaged and is generated again."""


class ImageCache:
    """PNG images and their JSON records in ``folder``, by key.

    Example:
        >>> cache = ImageCache(Path(tempfile.mkdtemp()))  # doctest: +SKIP
        >>> cache.store("k", image, {"seconds": 1.5})     # doctest: +SKIP
        >>> cache.load("k")                                # doctest: +SKIP
        (<PIL.Image.Image ...>, {'seconds': 1.5})
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def image_path(self, key: str) -> Path:
        return self.folder / f"{key}.png"

    def record_path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def _damaged(self, key: str, path: Path, why: str) -> None:
        warnings.warn(f"damaged cache entry {path} ({why}): it is generated again", CacheWarning, stacklevel=3)
        for p in (self.record_path(key), self.image_path(key)):  # the record first: no record, no entry
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def load(self, key: str):
        """``(image, record)`` of a whole entry, or None when there is none; a damaged entry is removed, with a
        ``CacheWarning`` naming the file, and None is returned."""
        from PIL import Image

        record_path, image_path = self.record_path(key), self.image_path(key)
        if not record_path.exists():  # never written, or interrupted before its record: generated again
            return None
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            seconds = record["seconds"]
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
                raise ValueError(f"'seconds' is {seconds!r}, not a number")
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._damaged(key, record_path, f"{type(err).__name__}: {str(err)[:200]}")
            return None
        try:
            with Image.open(image_path) as img:
                img.load()
                image = img.copy()
        except Exception as err:  # decoders raise many types (OSError, SyntaxError, ValueError, zlib.error...)
            self._damaged(key, image_path, f"{type(err).__name__}: {str(err)[:200]}")
            return None
        return image, record

    def store(self, key: str, image, record: dict) -> None:
        """Write the image, then its record, each atomically."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.image_path(key), lambda tmp: image.save(tmp, format="PNG"))
        text = json.dumps(record)
        atomic_write(self.record_path(key), lambda tmp: tmp.write_text(text, encoding="utf-8"))
