"""The IBP stored format: constants, row geometry, dtype names and the on-disk container.

Everything here is NumPy/stdlib only, so the format can be read without torch kernels or CUDA.
The bit layout itself is specified in docs/FORMAT.md; the encoders live in ``ibpcache/kernels``.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from .errors import FormatError, InvalidArgumentError
from .kernels.layout import GROUP_CHUNKS  # defined with the kernels, which may not import this module

__all__ = [
    "FORMAT_VERSION",
    "GROUP_CHUNKS",
    "CHUNK_SIZES",
    "MAGIC",
    "Layout",
    "FileKind",
    "RowGeometry",
    "dtype_to_name",
    "name_to_dtype",
    "write_container",
    "read_container",
]

FORMAT_VERSION = 1
"""Bumped whenever the bit layout or the container changes; readers refuse other versions."""


CHUNK_SIZES = (1, 2, 4, 8)
MAGIC = b"IBPCACHE"
_PREFIX = struct.Struct("<8sIIQ")  # magic, version, kind, json length
_SECTION = struct.Struct("<Q")
_TRAILER = struct.Struct("<I")


class Layout(str, enum.Enum):
    """Host layout of compressed rows.

    ``inplace``: row i starts at ``i * row_bytes`` (random access without an offset table, as in the
    paper; the slot's tail after the stored bytes is zero). ``packed``: rows back to back, located by an
    int64 offset table (saves host RAM).
    """

    INPLACE = "inplace"
    PACKED = "packed"

    @classmethod
    def from_str(cls, value: "str | Layout") -> "Layout":
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgumentError(f"layout must be one of {[m.value for m in cls]}, got {value!r}") from None


class FileKind(enum.IntEnum):
    """What a saved container holds."""

    CODEC = 1
    ROWS = 2


_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_to_name(dtype: torch.dtype) -> str:
    """Stable name of a torch dtype for headers; raises for dtypes the codec does not store."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise FormatError(f"unsupported dtype {dtype}; supported: {sorted(_DTYPES)}")


def name_to_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"unknown dtype name {name!r} in header") from None


@dataclass(frozen=True)
class RowGeometry:
    """How a row of ``row_bytes`` bytes is cut into chunks of ``chunk_bytes``.

    The last chunk may be partial: its missing high bytes read as zero and are never written back.
    """

    row_bytes: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.chunk_bytes not in CHUNK_SIZES:
            raise InvalidArgumentError(f"chunk_bytes must be one of {CHUNK_SIZES}, got {self.chunk_bytes}")
        if self.row_bytes < 1:
            raise InvalidArgumentError(f"row_bytes must be >= 1, got {self.row_bytes}")

    @property
    def n_chunks(self) -> int:
        return -(-self.row_bytes // self.chunk_bytes)

    @property
    def chunk_bits(self) -> int:
        return self.chunk_bytes * 8

    @property
    def padded_bytes(self) -> int:
        return self.n_chunks * self.chunk_bytes

    def padding_mask(self) -> np.ndarray:
        """uint64 [n_chunks]: bits of each chunk that lie past the row end (only the last chunk has any)."""
        pad = np.zeros(self.n_chunks, dtype=np.uint64)
        tail = self.padded_bytes - self.row_bytes
        if tail:
            valid_bits = (self.chunk_bytes - tail) * 8
            full = (1 << self.chunk_bits) - 1
            pad[-1] = np.uint64(full & ~((1 << valid_bits) - 1))
        return pad


# ----------------------------------------------------------------------------------------------
# On-disk container: prefix | json header | sections | crc32 trailer
# ----------------------------------------------------------------------------------------------


def write_container(path: "str | Path", kind: FileKind, header: dict, sections: list[np.ndarray]) -> None:
    """Write a self-describing file: magic, version, kind, JSON header, raw sections, CRC32 of all of it.

    Sections are written as little-endian raw bytes in order; their dtypes and shapes go in ``header``.
    """
    hdr = dict(header)
    hdr["sections"] = [[str(s.dtype), list(s.shape)] for s in sections]
    blob = json.dumps(hdr, sort_keys=True).encode()
    crc = 0
    with open(path, "wb") as f:
        crc = _write_crc(f, _PREFIX.pack(MAGIC, FORMAT_VERSION, int(kind), len(blob)), crc)
        crc = _write_crc(f, blob, crc)
        for s in sections:
            arr = np.ascontiguousarray(s)
            crc = _write_crc(f, _SECTION.pack(arr.nbytes), crc)
            view = memoryview(arr.reshape(-1).view(np.uint8))
            for start in range(0, len(view), 1 << 26):
                crc = _write_crc(f, view[start : start + (1 << 26)], crc)
        f.write(_TRAILER.pack(crc & 0xFFFFFFFF))


def _write_crc(f: BinaryIO, data: "bytes | memoryview", crc: int) -> int:
    f.write(data)
    return zlib.crc32(data, crc)


def read_container(path: "str | Path", kind: FileKind) -> tuple[dict, list[np.ndarray]]:
    """Read and verify a file written by :func:`write_container`; raise FormatError naming the defect."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    raw = np.fromfile(path, dtype=np.uint8)
    buf = memoryview(raw)
    if len(buf) < _PREFIX.size + _TRAILER.size:
        raise FormatError(f"{path}: truncated ({len(buf)} bytes is shorter than the header)")
    magic, version, file_kind, json_len = _PREFIX.unpack(buf[: _PREFIX.size])
    if magic != MAGIC:
        raise FormatError(f"{path}: not an ibpcache file (bad magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: format version {version} is not supported (this build reads {FORMAT_VERSION})")
    if file_kind != int(kind):
        raise FormatError(f"{path}: holds a {FileKind(file_kind).name if file_kind in (1, 2) else file_kind} "
                          f"container, expected {kind.name}")
    body_end = len(buf) - _TRAILER.size
    (stored_crc,) = _TRAILER.unpack(buf[body_end:])
    if zlib.crc32(buf[:body_end]) & 0xFFFFFFFF != stored_crc:
        raise FormatError(f"{path}: checksum mismatch (file is corrupt or truncated)")
    pos = _PREFIX.size
    if pos + json_len > body_end:
        raise FormatError(f"{path}: truncated header")
    try:
        header = json.loads(bytes(buf[pos : pos + json_len]))
    except ValueError as exc:
        raise FormatError(f"{path}: unreadable header ({exc})") from None
    pos += json_len
    sections = []
    for dtype_name, shape in header.get("sections", []):
        if pos + _SECTION.size > body_end:
            raise FormatError(f"{path}: truncated before a section")
        (nbytes,) = _SECTION.unpack(buf[pos : pos + _SECTION.size])
        pos += _SECTION.size
        if pos + nbytes > body_end:
            raise FormatError(f"{path}: truncated section ({nbytes} bytes announced)")
        dt = np.dtype(dtype_name)
        expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if expected != nbytes:
            raise FormatError(f"{path}: section size {nbytes} does not match shape {shape} of {dtype_name}")
        sections.append(raw[pos : pos + nbytes].view(dt).reshape(shape))
        pos += nbytes
    if pos != body_end:
        raise FormatError(f"{path}: {body_end - pos} unexpected trailing bytes")
    return header, sections

