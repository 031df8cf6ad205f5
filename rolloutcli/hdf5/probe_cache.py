"""What ``probed_once`` (:mod:`rolloutcli.hdf5.probe`) keeps of each file found sound, packed for datasets of
thousands of files.

An entry is ~0.1 KB: its key a 128-bit digest of the probe's key (path, options, the file's identity), its value
the answer (the identity found clean and the listing) as JSON compressed with zlib, the first entry's JSON
being the preset dictionary. A dataset's files share nearly all of their listings' bytes (the same fields,
shapes and attributes), so an entry compresses to what differs: ~60 bytes of a small file's ~1 KB, ~420 without
the dictionary. Held as the key's objects and the listing packed alone, 10,000 files took ~11 MB of the driver.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import xxhash


class ProbeCache:
    """The answers of the probes of files found sound, by the probe's key (a tuple of what ``repr`` spells
    exactly: strings, ints and a frozen dataclass)."""

    def __init__(self) -> None:
        self._entries: dict[bytes, bytes] = {}
        self._dictionary = b""  # the first entry's JSON: zlib's preset dictionary for every entry

    @staticmethod
    def _digest(key: tuple[Any, ...]) -> bytes:
        # two keys share a digest with probability 2**-128 (XXH3-128): in practice, never
        return xxhash.xxh3_128_digest(repr(key).encode("utf-8", "surrogatepass"))

    def __contains__(self, key: tuple[Any, ...]) -> bool:
        return self._digest(key) in self._entries

    def get(self, key: tuple[Any, ...]) -> tuple[list[int] | None, dict[str, Any] | None] | None:
        """``(clean, listing)`` as :meth:`put` was given them (through JSON), or None where ``key`` has none."""
        packed = self._entries.get(self._digest(key))
        if packed is None:
            return None
        unpacker = zlib.decompressobj(zdict=self._dictionary)
        clean, listing = json.loads(unpacker.decompress(packed) + unpacker.flush())
        return clean, listing

    def put(self, key: tuple[Any, ...], clean: list[int] | None, listing: dict[str, Any] | None) -> None:
        text = json.dumps([clean, listing]).encode()
        if not self._entries:
            self._dictionary = text
        packer = zlib.compressobj(zdict=self._dictionary)
        self._entries[self._digest(key)] = packer.compress(text) + packer.flush()
