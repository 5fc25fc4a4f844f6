"""POSIX shared-memory segments holding one published store each (the low-level half of ``share``/``attach``).

One store = one file ``/dev/shm/ibpcache.<name>``, created with mode 0600 (only the creating user can read
it), written completely under a temporary name and then renamed over ``<name>`` (atomic on tmpfs). A reader
therefore opens either the previous complete segment or the new complete one, never a half-written one, and
because manifest, tables and payload live in the same inode they can never come from two generations.

Segment layout (little-endian)::

    [0, 4096)     header page: magic, version, state, generation, uid, manifest length/CRC, then the JSON manifest
    then          each section at a 4096-aligned offset (manifest["sections"][name] = [offset, nbytes, dtype, shape])

``state`` is the one word the owner writes after publication: READY (1) once complete, RETIRED (2) when the
store is replaced or its host stops. Readers check it (plus generation and uid) cheaply before each use, so a
client of a replaced store gets :class:`StaleStoreError` instead of silently reading the old copy forever;
the bytes it already mapped stay valid (an unlinked tmpfs file lives until its last mapping goes), so a reader
mid-fetch never reads freed memory. Readers map the file ``PROT_READ``: they cannot write into it (a write
through a numpy view raises, a raw write faults in the reader only), so a client that dies mid-fetch harms
nobody.

This module opens ``/dev/shm`` directly with ``os.open`` + ``mmap`` rather than ``multiprocessing.shared_memory``:
that class registers every segment, even an attached one, with the ``resource_tracker`` on Python < 3.13, which
unlinks it when the attaching process exits (CPython issue 82300). Nothing here registers with the tracker.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import FormatError, IbpcacheError

__all__ = ["SHM_DIR", "StaleStoreError", "Segment", "publish", "open_segment", "segment_path", "list_segments",
           "register_host", "unregister_host"]

SHM_DIR = Path(os.environ.get("IBPCACHE_SHM_DIR", "/dev/shm"))
_PREFIX = "ibpcache."
_MAGIC = b"IBPSHM01"
_VERSION = 1
_PAGE = 4096
# magic, version, state, generation, uid, manifest length, manifest crc32
_HEADER = struct.Struct("<8sIIQQQI")
_STATE_OFFSET = 12  # byte offset of the u32 state word inside the header
_BUILDING, _READY, _RETIRED = 0, 1, 2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
_CRC_STEP = 1 << 26


class StaleStoreError(IbpcacheError, RuntimeError):
    """The shared store this object was attached to has been replaced or its host has stopped; attach again."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"shared store name must match {_NAME_RE.pattern} (letters, digits, '_', '.', '-'), "
                         f"got {name!r}")
    return name


def segment_path(name: str) -> Path:
    """The /dev/shm file that backs store ``name``."""
    return SHM_DIR / (_PREFIX + _check_name(name))


def list_segments() -> list[str]:
    """Names of the stores currently published on this node (by this or any user)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name[len(_PREFIX):] for p in SHM_DIR.iterdir()
                  if p.name.startswith(_PREFIX) and not p.name.endswith(".tmp"))


def _align(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _crc(buf: "np.ndarray | memoryview | bytes", crc: int = 0) -> int:
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    for start in range(0, len(view), _CRC_STEP):
        crc = zlib.crc32(view[start : start + _CRC_STEP], crc)
    return crc & 0xFFFFFFFF


@dataclass
class Segment:
    """One mapped store segment: its manifest, read-only (reader) or writable (owner) section views."""

    name: str
    path: Path
    mm: mmap.mmap
    manifest: dict
    sections: dict[str, np.ndarray]
    owner: bool
    generation: int
    uid: int
    _header: np.ndarray = field(repr=False, default=None)  # type: ignore[assignment]
    _registered: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._header = np.frombuffer(self.mm, dtype=np.uint8, count=_HEADER.size)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this segment occupies (header page + aligned sections)."""
        return len(self.mm)

    def state(self) -> int:
        return int(self._header[_STATE_OFFSET : _STATE_OFFSET + 4].view(np.uint32)[0])

    def check(self) -> None:
        """Raise :class:`StaleStoreError` unless this segment is still the published generation (a few loads)."""
        hdr = self._header
        state = int(hdr[_STATE_OFFSET : _STATE_OFFSET + 4].view(np.uint32)[0])
        gen = int(hdr[16:24].view(np.uint64)[0])
        uid = int(hdr[24:32].view(np.uint64)[0])
        if state != _READY or gen != self.generation or uid != self.uid:
            what = "was replaced by a newer generation" if state == _RETIRED else "is no longer valid"
            raise StaleStoreError(f"shared store {self.name!r} (generation {self.generation}) {what}; "
                                  f"attach again to read the current one")

    def verify_payload(self) -> None:
        """Recompute every section's CRC32 against the manifest (reads every byte: minutes for 100s of GB)."""
        for key, (_, _, _, _, crc) in self.manifest["sections"].items():
            if _crc(self.sections[key]) != crc:
                raise FormatError(f"shared store {self.name!r}: section {key!r} fails its checksum")

    def retire(self) -> None:
        """Owner only: mark this generation stale for every reader (they raise on their next use)."""
        if not self.owner:
            raise PermissionError("only the process that published a store can retire it")
        struct.pack_into("<I", self.mm, _STATE_OFFSET, _RETIRED)
        self.mm.flush(0, _PAGE)

    def unlink(self) -> None:
        """Owner only: retire the segment and remove its name (mapped readers keep their bytes until they close)."""
        self.retire()
        try:
            st = os.stat(self.path)
            if _read_identity(self.path) == (self.generation, self.uid) or st.st_size == 0:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this process's mapping (CUDA registrations first). Tensors still viewing it keep it alive."""
        for ptr in self._registered:
            unregister_host(ptr)
        self._registered.clear()
        self.sections = {}
        self._header = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # views are still exported (e.g. a tensor over the payload); the map goes when they do


def _read_identity(path: Path) -> "tuple[int, int] | None":
    """(generation, uid) of the segment currently at ``path`` or None if it is absent/unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, _, _, gen, uid, _, _ = _HEADER.unpack(raw)
    return (gen, uid) if magic == _MAGIC else None


def _open_old(path: Path) -> "int | None":
    """A writable descriptor on the segment about to be replaced (so its readers can be told), or None."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None


def publish(name: str, manifest: dict, sections: dict[str, np.ndarray], *, replace: bool = True) -> Segment:
    """Create segment ``name`` (mode 0600) holding ``sections`` + ``manifest``; return the owner's handle.

    ``replace=False`` refuses to overwrite an existing store. With ``replace=True`` the new generation is
    renamed over the old one and the old one is retired, so its readers get :class:`StaleStoreError`.
    """
    path = segment_path(name)
    if not SHM_DIR.is_dir():
        raise OSError(f"{SHM_DIR} does not exist: POSIX shared memory is needed to share a store")
    old = _read_identity(path)
    if old is not None and not replace:
        raise FileExistsError(f"a shared store named {name!r} already exists ({path}); pass replace=True")
    generation = (old[0] + 1) if old is not None else 1
    uid = secrets.randbits(63)
    layout: dict[str, list] = {}
    pos = _PAGE
    for key, arr in sections.items():
        arr = np.ascontiguousarray(arr)
        sections[key] = arr
        layout[key] = [pos, int(arr.nbytes), str(arr.dtype), list(arr.shape), _crc(arr)]
        pos = _align(pos + arr.nbytes + 16)  # 16 spare bytes after each section: the decoders' aligned reads
    man = dict(manifest, generation=generation, uid=uid, sections=layout)
    blob = json.dumps(man, sort_keys=True).encode()
    if _HEADER.size + len(blob) > _PAGE:
        raise ValueError(f"shared store manifest is {len(blob)} bytes; at most {_PAGE - _HEADER.size} fit")
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        os.ftruncate(fd, pos)
        mm = mmap.mmap(fd, pos, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        views: dict[str, np.ndarray] = {}
        for key, arr in sections.items():
            off, nbytes, dt, shape, _ = layout[key]
            dst = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off)
            src = arr.reshape(-1).view(np.uint8)
            for s in range(0, nbytes, _CRC_STEP):
                dst[s : s + _CRC_STEP] = src[s : s + _CRC_STEP]
            views[key] = dst.view(np.dtype(dt)).reshape(shape)
        mm[_HEADER.size : _HEADER.size + len(blob)] = blob
        _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, _BUILDING, generation, uid, len(blob), _crc(blob))
        struct.pack_into("<I", mm, _STATE_OFFSET, _READY)  # last write: the segment is complete
        old_fd = _open_old(path)
        os.rename(tmp, path)  # atomic: readers see the old complete segment or this one
    except BaseException:
        views = {}
        try:
            mm.close()
        except BufferError:
            pass
        os.unlink(tmp)
        raise
    if old_fd is not None:  # the replaced inode, still mapped by its readers: tell them it is stale
        os.pwrite(old_fd, struct.pack("<I", _RETIRED), _STATE_OFFSET)
        os.close(old_fd)
    return Segment(name, path, mm, man, views, owner=True, generation=generation, uid=uid)


def open_segment(name: str, *, retries: int = 3) -> Segment:
    """Map store ``name`` read-only; validate magic, version, state and the manifest's checksum."""
    path = segment_path(name)
    last: Exception | None = None
    for _ in range(max(1, retries)):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared store named {name!r} ({path} is absent: is the host running?)") \
                from None
        try:
            size = os.fstat(fd).st_size
            if size < _PAGE:
                raise FormatError(f"shared store {name!r}: segment is {size} bytes, too small to be a store")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, state, gen, uid, mlen, mcrc = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            mm.close()
            raise FormatError(f"shared store {name!r}: {path} is not an ibpcache segment")
        if version != _VERSION:
            mm.close()
            raise FormatError(f"shared store {name!r}: segment version {version}, this build reads {_VERSION}")
        if state != _READY:  # retired between our open and now: a newer generation is (being) renamed in
            mm.close()
            last = StaleStoreError(f"shared store {name!r}: generation {gen} is retired")
            continue
        blob = mm[_HEADER.size : _HEADER.size + mlen]
        if _crc(blob) != mcrc:
            mm.close()
            raise FormatError(f"shared store {name!r}: manifest checksum mismatch")
        man = json.loads(blob)
        if man.get("generation") != gen or man.get("uid") != uid:
            mm.close()
            raise FormatError(f"shared store {name!r}: manifest generation {man.get('generation')} does not "
                              f"match the segment header's {gen}")
        views = {}
        for key, (off, nbytes, dt, shape, _) in man["sections"].items():
            if off % _PAGE or off + nbytes > size:
                mm.close()
                raise FormatError(f"shared store {name!r}: section {key!r} lies outside the segment")
            views[key] = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off).view(np.dtype(dt)).reshape(shape)
        return Segment(name, path, mm, man, views, owner=False, generation=gen, uid=uid)
    raise last if last is not None else StaleStoreError(f"shared store {name!r} could not be opened")


# -- CUDA registration of a read-only mapping -------------------------------------------------------------------

_HOST_REGISTER_MAPPED = 0x02
_HOST_REGISTER_READ_ONLY = 0x08


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock ``[ptr, ptr+nbytes)`` for the GPU in place (``cudaHostRegister``, mapped + read-only).

    The payload is then read by GPU warps through UVA exactly like ``pin_memory`` bytes, with no copy. Uses
    CuPy's runtime bindings when present, else ``torch.cuda.cudart()``. Needs CUDA; CPU paths never call it.
    """
    import torch

    # The kernels read the payload at its host address (UVA), which holds only where the device may use the host
    # pointer of registered memory (cudaDevAttrCanUseHostPointerForRegisteredMem; CuPy 14 has no
    # cudaHostGetDevicePointer binding to compare addresses with).
    same_address = torch.cuda.get_device_properties(torch.cuda.current_device())
    if not getattr(same_address, "can_use_host_pointer_for_registered_mem", True):
        raise RuntimeError("this GPU cannot use host pointers of registered memory (no UVA mapping); the zero-copy "
                           "host store needs it")
    flags = _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY
    try:
        import cupy.cuda.runtime as rt

        rt.hostRegister(ptr, nbytes, flags)
    except ImportError:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}") from None


def unregister_host(ptr: int) -> None:
    """Undo :func:`register_host` (errors ignored: the process may be tearing CUDA down)."""
    try:
        import cupy.cuda.runtime as rt

        rt.hostUnregister(ptr)
    except ImportError:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
