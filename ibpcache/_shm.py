"""POSIX shared-memory segments holding one published store each (the low-level half of ``share``/``attach``).

One store = one file ``/dev/shm/ibpcache.<name>``, created with mode 0600 (only the creating user can read
it), written completely under a temporary name and then renamed over ``<name>`` (atomic on tmpfs). A reader
therefore opens either the previous complete segment or the new complete one, never a half-written one, and
because manifest, tables and payload live in the same inode they can never come from two generations.

Segment layout (little-endian)::

    [0, 4096)     header page: magic, version, state, generation, uid, manifest length/CRC, then the JSON manifest
    then          each section at a 4096-aligned offset (manifest["sections"][name] = [offset, nbytes, dtype, shape])

``state`` is the one word written after publication: READY (1) once complete, then RETIRED (2) when a newer
generation replaces it, STOPPED (3) when its owner removes it (a store host stopping, a handle closed or dropped),
ORPHANED (4) when a sweep removes it because its owner died. Readers check it (plus generation and uid) cheaply
before each use, so a client gets :class:`StaleStoreError` saying which of these happened instead of silently
reading the old copy forever; the bytes it already mapped stay valid (an unlinked tmpfs file lives until its last
mapping goes), so a reader mid-fetch never reads freed memory.

Lifecycle: a segment lives as long as the process that published it (its owner), never longer.

* The manifest names the owner: pid, start time (field 22 of ``/proc/<pid>/stat``, so a recycled pid is not
  taken for the owner), boot id and pid namespace (:class:`Owner`).
* The owner's handle removes the segment when it is closed, when it is dropped, and at a normal interpreter exit
  (``weakref.finalize``). A store host (``task=serve``) keeps its handles until it stops.
* An owner that dies without running that (kill -9, an OOM kill, SIGTERM of a script with no handler) leaves the
  file behind. :func:`sweep` removes every segment of this user whose owner is gone; every :func:`publish` and
  :func:`open_segment` (``share``, ``attach``, ``serve``) runs it first, and ``python -m ibpcache task=gc`` runs it
  alone. A segment whose owner cannot be judged (none recorded, or another pid namespace) is kept.
* Readers never remove anything: a client that dies, however it dies, leaves the store as it was.

Mappings. The owner maps the file shared and writable. A reader maps it twice:

* The sections (the tensors of an attached ``CompressedRows``) are mapped private, copy-on-write. A write into an
  attached store (``rows.data[0] = 1``) then copies that one page for the writer and never reaches the shared
  bytes or any other process; torch has no read-only tensors to refuse it with an exception, and a ``PROT_READ``
  mapping would kill the writer with SIGSEGV instead. The numpy section views are flagged read-only (a write
  through them raises ValueError). Pages nobody writes are the shared pages themselves: no extra memory.
* The header and the bytes GPU kernels read are mapped shared and read-only. The owner's state changes are visible
  there whatever the reader wrote, and ``cudaHostRegister`` page-locks the shared pages themselves. Registering
  the private mapping would not do: drivers pin registered memory long-term (``FOLL_LONGTERM``), and Linux >= 6.2
  breaks copy-on-write on every page of a private mapping pinned that way, i.e. each process would get a private
  copy of the whole store. The GPU therefore never sees a reader's private writes.

Where the kernel refuses a private writable mapping of the whole store (strict overcommit,
``vm.overcommit_memory=2``, charges it in full) the sections use the shared read-only mapping and a raw write
faults, as a plain ``PROT_READ`` reader would.

A mapping is unmapped only when the last array or tensor viewing it is gone, and its CUDA registration is removed
just before that. The driver keeps a registration past ``munmap``: a later pinned allocation that the kernel
places at an overlapping address fails with "resource already mapped", in whatever code runs next.

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
import stat
import struct
import threading
import weakref
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .errors import CapacityError, FormatError, IbpcacheError, InvalidArgumentError

__all__ = ["SHM_DIR", "StaleStoreError", "Segment", "Owner", "SweepReport", "publish", "open_segment", "segment_path",
           "list_segments", "sweep", "release"]

SHM_DIR = Path(os.environ.get("IBPCACHE_SHM_DIR", "/dev/shm"))
_PREFIX = "ibpcache."
_MAGIC = b"IBPSHM01"
_VERSION = 1
_PAGE = 4096
# magic, version, state, generation, uid, manifest length, manifest crc32
_HEADER = struct.Struct("<8sIIQQQI")
_STATE_OFFSET = 12  # byte offset of the u32 state word inside the header
_BUILDING, _READY, _RETIRED, _STOPPED, _ORPHANED = 0, 1, 2, 3, 4
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
_CRC_STEP = 1 << 26
_PROC = Path("/proc")


class StaleStoreError(IbpcacheError, RuntimeError):
    """The shared store this object was attached to was replaced, removed by its owner, or its owner died."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgumentError(f"shared store name must match {_NAME_RE.pattern} (letters, digits, '_', '.', '-'), "
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


# -- who owns a segment -----------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> "tuple[str, int] | None":
    """(state letter, start time in clock ticks after boot) of process ``pid``; None when there is no such process."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # from field 3 on; the command name may hold spaces and ")"
    return fields[0].decode(), int(fields[19])  # fields 3 (state) and 22 (starttime)


def _boot_id() -> Optional[str]:
    try:
        return (_PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace() -> Optional[int]:
    try:
        return os.stat(_PROC / "self" / "ns" / "pid").st_ino
    except OSError:
        return None


def _have_proc() -> bool:
    return (_PROC / "self" / "stat").exists()


@dataclass(frozen=True)
class Owner:
    """The process that published a segment, as its manifest records it.

    ``start`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22) tells the owner from a later process that
    got the same pid; ``boot`` (the kernel's boot id) tells a segment of an earlier boot, where ``/dev/shm`` is not
    a tmpfs; ``pidns`` (inode of ``/proc/self/ns/pid``) tells a pid of another pid namespace (a container sharing
    this ``/dev/shm``), whose liveness cannot be judged from here. Any of them is None where the system has no
    ``/proc``; liveness then rests on the pid alone.
    """

    pid: int
    start: Optional[int] = None
    boot: Optional[str] = None
    pidns: Optional[int] = None

    @classmethod
    def current(cls) -> "Owner":
        """This process."""
        pid = os.getpid()
        st = _proc_stat(pid) if _have_proc() else None
        return cls(pid, st[1] if st else None, _boot_id(), _pid_namespace())

    @classmethod
    def from_manifest(cls, value: Any) -> "Owner | None":
        """The owner recorded in a manifest (None when there is none or it is malformed)."""
        if not isinstance(value, dict) or not isinstance(value.get("pid"), int):
            return None
        start, boot, ns = value.get("start"), value.get("boot"), value.get("pidns")
        return cls(int(value["pid"]), start if isinstance(start, int) else None,
                   boot if isinstance(boot, str) else None, ns if isinstance(ns, int) else None)

    def to_manifest(self) -> dict[str, Any]:
        return asdict(self)

    def alive(self) -> Optional[bool]:
        """Whether the owner still runs: True, False, or None where this process cannot tell."""
        boot = _boot_id()
        if self.boot is not None and boot is not None and self.boot != boot:
            return False  # published before the machine last booted
        ns = _pid_namespace()
        if self.pidns is not None and ns is not None and self.pidns != ns:
            return None
        if not _have_proc():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True  # exists, another user's
            return True
        st = _proc_stat(self.pid)
        if st is None or st[0] in ("Z", "X"):  # gone, or exited and not yet reaped by its parent
            return False
        return self.start is None or st[1] == self.start


# -- mappings ----------------------------------------------------------------------------------------------------


def _unmap(mm: mmap.mmap, addr: int, registered: list[bool], pid: int) -> None:
    """Finalizer of a :class:`_Mapping`: CUDA registration first, then ``munmap``."""
    if registered[0] and os.getpid() == pid:
        registered[0] = False
        _unregister(addr)
    try:
        mm.close()
    except BufferError:  # an export outlived every view (cannot happen: views go through __array_interface__)
        pass


def _unregister(addr: int) -> None:
    from .kernels._build import host_unregister

    try:
        host_unregister(addr)
    except Exception:  # noqa: BLE001 - CUDA may already be torn down; the process's registrations end with it
        pass


class _Mapping:
    """One ``mmap`` of a segment file, alive while any array viewing it is.

    Arrays come from :meth:`array` through ``__array_interface__``, so each holds this object as its base (and
    tensors made from them hold the arrays): the file stays mapped exactly as long as something can still read
    it, and when the last view goes the finalizer removes the CUDA registration and only then unmaps.
    """

    def __init__(self, fd: int, size: int, *, writable: bool = False, private: bool = False) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED, prot=prot)
        probe = np.frombuffer(mm, dtype=np.uint8, count=1)  # an export only long enough to learn the address
        self.addr = int(probe.ctypes.data)
        del probe
        self.size = size
        self.writable = writable
        self.private = private
        self._registered = [False]  # shared with the finalizer
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _unmap, mm, self.addr, self._registered, os.getpid())
        self._finalizer.atexit = False  # at exit the OS unmaps; views may still be read by other exit handlers

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"data": (self.addr, not self.writable), "shape": (self.size,), "typestr": "|u1", "version": 3}

    def array(self, offset: int = 0, nbytes: "int | None" = None, dtype: Any = np.uint8,
              shape: "tuple[int, ...] | list[int] | None" = None, writable: bool = True) -> np.ndarray:
        """A numpy view of ``[offset, offset + nbytes)`` as ``dtype``/``shape`` (read-only unless both allow)."""
        end = self.size if nbytes is None else offset + nbytes
        view = np.asarray(self)[offset:end].view(np.dtype(dtype))
        if shape is not None:
            view = view.reshape(shape)
        if not writable:
            view.flags.writeable = False
        return view

    def contains(self, ptr: int) -> bool:
        return self.addr <= ptr < self.addr + self.size

    @property
    def registered(self) -> bool:
        return self._registered[0]

    def register_cuda(self) -> None:
        """Page-lock the whole mapping for the GPU (read-only), once; undone before the mapping goes."""
        with self._lock:
            if self._registered[0]:
                return
            from .kernels._build import host_register_read_only

            host_register_read_only(self.addr, self.size)
            self._registered[0] = True

    def unregister_cuda(self) -> None:
        """Undo :meth:`register_cuda` now (no GPU read of this mapping may follow)."""
        with self._lock:
            if self._registered[0]:
                self._registered[0] = False
                _unregister(self.addr)


def _state_word(header: np.ndarray) -> np.ndarray:
    return header[_STATE_OFFSET : _STATE_OFFSET + 4].view(np.uint32)


def _retire(header: np.ndarray, state: int) -> None:
    """Set a live (building or ready) segment's state; a replaced one keeps saying so."""
    word = _state_word(header)
    if int(word[0]) in (_BUILDING, _READY):
        word[0] = state


def _end_owner(path: Path, generation: int, uid: int, header: np.ndarray, pid: int) -> None:
    """Finalizer of an owner's handle: say STOPPED to readers and remove the file if it still is this generation."""
    if os.getpid() != pid:  # a forked child dropping its copy of the handle: the store is its parent's
        return
    _retire(header, _STOPPED)
    try:
        if _read_identity(path) == (generation, uid):
            os.unlink(path)
    except FileNotFoundError:
        pass


_HANDLES: "weakref.WeakSet[Segment]" = weakref.WeakSet()


class Segment:
    """One mapped store segment: manifest, section views and state, as the owner or a reader of it.

    The owner's handle removes the segment when it is closed or dropped, or when the process exits normally;
    a reader's handle never removes anything.
    """

    def __init__(self, name: str, path: Path, manifest: dict, sections: dict[str, np.ndarray], *, owner: bool,
                 generation: int, uid: int, mapping: _Mapping, shared: _Mapping) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.sections = sections
        self.owner = owner
        self.generation = generation
        self.uid = uid
        self.published_by = Owner.from_manifest(manifest.get("owner"))
        self._mapping = mapping  # the sections' (owner: shared writable; reader: private copy-on-write)
        self._shared = shared  # shared: the header's and the GPU's (the owner's own mapping)
        self._header = shared.array(0, _HEADER.size, writable=owner)
        self._gpu: dict[str, np.ndarray] = {}
        self._closed = False
        self._end = (weakref.finalize(self, _end_owner, path, generation, uid, self._header, os.getpid())
                     if owner else None)
        _HANDLES.add(self)

    def __repr__(self) -> str:
        role = "owner" if self.owner else "reader"
        return f"Segment({self.name!r}, generation={self.generation}, {role}, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this segment occupies (header page + aligned sections)."""
        return self._shared.size

    @property
    def private(self) -> bool:
        """Whether this reader's sections are a private copy-on-write mapping (writes stay in this process)."""
        return self._mapping.private

    @property
    def registered(self) -> bool:
        """Whether the segment is page-locked for CUDA in this process (see :meth:`gpu_view`)."""
        return self._shared.registered

    def contains(self, ptr: int) -> bool:
        """Whether address ``ptr`` lies in one of this process's mappings of the segment (a view, not a copy)."""
        return self._mapping.contains(ptr) or self._shared.contains(ptr)

    def state(self) -> int:
        self._check_open()
        return int(_state_word(self._header)[0])

    def _check_open(self) -> None:
        if self._closed:
            raise StaleStoreError(f"shared store {self.name!r}: this handle was closed; attach again")

    def check(self) -> None:
        """Raise :class:`StaleStoreError` unless this segment is still the published generation (a few loads)."""
        self._check_open()
        hdr = self._header
        state = int(_state_word(hdr)[0])
        gen = int(hdr[16:24].view(np.uint64)[0])
        uid = int(hdr[24:32].view(np.uint64)[0])
        if state != _READY or gen != self.generation or uid != self.uid:
            raise StaleStoreError(f"shared store {self.name!r} (generation {self.generation}) {self._why(state)}; "
                                  f"attach again to read the current one")

    def _why(self, state: int) -> str:
        pid = f" (pid {self.published_by.pid})" if self.published_by is not None else ""
        return {_RETIRED: "was replaced by a newer generation",
                _STOPPED: f"was removed: its store host{pid} stopped or dropped it",
                _ORPHANED: f"was removed: the process that shared it{pid} died"}.get(state, "is no longer valid")

    def verify_payload(self) -> None:
        """Recompute every section's CRC32 against the manifest (reads every byte: minutes for 100s of GB)."""
        for key, (_, _, _, _, crc) in self.manifest["sections"].items():
            if _crc(self.sections[key]) != crc:
                raise FormatError(f"shared store {self.name!r}: section {key!r} fails its checksum")

    def gpu_view(self, key: str) -> np.ndarray:
        """Section ``key`` as the GPU reads it: through the shared read-only mapping, page-locked in place for
        CUDA (``cudaHostRegister``, once per process) so kernels read the shared pages at their host address."""
        self._check_open()
        if key not in self._gpu:
            off, nbytes, dt, shape, _ = self.manifest["sections"][key]
            self._shared.register_cuda()
            self._gpu[key] = self._shared.array(off, nbytes, dt, shape, writable=False)
        return self._gpu[key]

    def unlink(self) -> None:
        """Owner only: mark the segment STOPPED for every reader (they raise on their next use) and remove its
        name if it is still this generation. Mapped readers keep their bytes until they let go of them."""
        if not self.owner:
            raise PermissionError("only the process that published a store can remove it")
        self._end()

    def close(self) -> None:
        """Let go of this handle (idempotent). The owner's removes the segment (:meth:`unlink`); a reader's drops
        its CUDA registration now, so no GPU read of this store may follow. Arrays and tensors still viewing the
        bytes keep them mapped until they go."""
        if self._closed:
            return
        if self.owner:
            self._end()
        else:
            self._shared.unregister_cuda()
        self._closed = True
        self.sections = {}
        self._gpu = {}


def release(name: "str | None" = None) -> int:
    """Close every handle this process holds on store ``name`` (all stores when None); returns how many.

    For teardown paths that must leave no segment and no page-locked mapping behind even after a failure (a
    job's ``finally``, a test fixture): owners' segments are removed, readers' CUDA registrations dropped.
    """
    handles = [h for h in list(_HANDLES) if name is None or h.name == name]
    for h in handles:
        h.close()
    return len(handles)


# -- the segment at a path ---------------------------------------------------------------------------------------


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


def _manifest_of(page: bytes) -> "dict | None":
    """The manifest in a segment's first page, or None unless magic and manifest checksum are right."""
    if len(page) < _HEADER.size:
        return None
    magic, _, _, _, _, mlen, mcrc = _HEADER.unpack_from(page, 0)
    blob = page[_HEADER.size : _HEADER.size + mlen]
    if magic != _MAGIC or len(blob) != mlen or _crc(blob) != mcrc:
        return None
    try:
        man = json.loads(blob)
    except ValueError:
        return None
    return man if isinstance(man, dict) else None


def _open_old(path: Path) -> "int | None":
    """A writable descriptor on the segment about to be replaced (so its readers can be told), or None."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None


# -- sweeping segments whose owner is gone -----------------------------------------------------------------------


@dataclass
class SweepReport:
    """What :func:`sweep` did: file name (in ``SHM_DIR``) -> why, for the segments it removed and those it kept."""

    removed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


def _tmp_pid(file_name: str) -> Optional[int]:
    """The pid in a temporary file's name (``ibpcache.<name>.<pid>.<hex>.tmp``)."""
    parts = file_name.rsplit(".", 3)
    return int(parts[1]) if len(parts) == 4 and parts[3] == "tmp" and parts[1].isdigit() else None


def _judge(path: str, file_name: str) -> "tuple[bool | None, str]":
    """(is its owner alive: True / False / None = cannot tell, why) for one of this user's segment files."""
    with open(path, "rb") as f:
        man = _manifest_of(f.read(_PAGE))
    owner = Owner.from_manifest(man.get("owner")) if man is not None else None
    if owner is None:
        pid = _tmp_pid(file_name)
        if pid is None:
            return None, "no owner recorded in it (not an ibpcache segment of this version)"
        owner, what = Owner(pid), f"half-written by pid {pid}"
    else:
        what = f"published by pid {owner.pid}"
    alive = owner.alive()
    if alive is None:
        return None, f"{what}, of another pid namespace: cannot tell whether it runs"
    return alive, f"{what}, which {'runs' if alive else 'is gone'}"


def _remove_orphan(path: str, judged: os.stat_result) -> bool:
    """Mark the segment judged at ``path`` ORPHANED for its readers and remove it; False if it was replaced since."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_ino != judged.st_ino:
            return False
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) == _HEADER.size and head[:8] == _MAGIC:
            state = struct.unpack_from("<I", head, _STATE_OFFSET)[0]
            if state in (_BUILDING, _READY):
                os.pwrite(fd, struct.pack("<I", _ORPHANED), _STATE_OFFSET)
        if os.stat(path).st_ino != judged.st_ino:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def sweep(*, dry_run: bool = False) -> SweepReport:
    """Remove every segment of this user (and half-written temporary file) whose owner process is gone.

    Other users' segments are kept (mode 0600: unreadable here, and the sticky ``/dev/shm`` lets only their owner
    remove them), as is any segment whose owner cannot be judged. Readers still mapping a removed segment keep
    their bytes and are told on their next check that its owner died. ``dry_run``: only report.
    """
    report = SweepReport()
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return report
    me = os.getuid()
    for entry in entries:
        if not entry.name.startswith(_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_uid != me:
                report.kept[entry.name] = f"belongs to uid {st.st_uid}"
                continue
            alive, why = _judge(entry.path, entry.name)
            if alive is not False:
                report.kept[entry.name] = why
            elif dry_run or _remove_orphan(entry.path, st):
                report.removed[entry.name] = why
        except OSError as exc:  # vanished or unreadable meanwhile: nothing to do for it now
            report.kept[entry.name] = f"could not be judged: {exc}"
    return report


# -- publish / open ----------------------------------------------------------------------------------------------


def publish(name: str, manifest: dict, sections: dict[str, np.ndarray], *, replace: bool = True) -> Segment:
    """Create segment ``name`` (mode 0600) holding ``sections`` + ``manifest``; return the owner's handle.

    ``replace=False`` refuses to overwrite an existing store. With ``replace=True`` the new generation is
    renamed over the old one and the old one is retired, so its readers get :class:`StaleStoreError`. Segments
    whose owner died are swept first. Keep the handle: closing or dropping it removes the segment.
    """
    path = segment_path(name)
    if not SHM_DIR.is_dir():
        raise OSError(f"{SHM_DIR} does not exist: POSIX shared memory is needed to share a store")
    sweep()
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
    man = dict(manifest, generation=generation, uid=uid, owner=Owner.current().to_manifest(), sections=layout)
    blob = json.dumps(man, sort_keys=True).encode()
    if _HEADER.size + len(blob) > _PAGE:
        raise CapacityError(f"shared store manifest is {len(blob)} bytes; at most {_PAGE - _HEADER.size} fit")
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        os.ftruncate(fd, pos)
        mapping = _Mapping(fd, pos, writable=True)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    old_fd = None
    try:
        whole = mapping.array()
        whole[_HEADER.size : _HEADER.size + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        # header first, state BUILDING: from here a sweep can tell whose half-written file this is
        _HEADER.pack_into(whole, 0, _MAGIC, _VERSION, _BUILDING, generation, uid, len(blob), _crc(blob))
        views: dict[str, np.ndarray] = {}
        for key, arr in sections.items():
            off, nbytes, dt, shape, _ = layout[key]
            dst = whole[off : off + nbytes]
            src = arr.reshape(-1).view(np.uint8)
            for s in range(0, nbytes, _CRC_STEP):
                dst[s : s + _CRC_STEP] = src[s : s + _CRC_STEP]
            views[key] = mapping.array(off, nbytes, dt, shape)
        _state_word(whole)[0] = _READY  # last write: the segment is complete
        del whole
        old_fd = _open_old(path)
        os.rename(tmp, path)  # atomic: readers see the old complete segment or this one
    except BaseException:
        if old_fd is not None:
            os.close(old_fd)
        tmp.unlink(missing_ok=True)
        raise
    if old_fd is not None:  # the replaced inode, still mapped by its readers: tell them it is stale
        try:
            os.pwrite(old_fd, struct.pack("<I", _RETIRED), _STATE_OFFSET)
        finally:
            os.close(old_fd)
    return Segment(name, path, man, views, owner=True, generation=generation, uid=uid, mapping=mapping,
                   shared=mapping)


def _map_reader(fd: int, size: int) -> tuple[_Mapping, _Mapping]:
    """(sections' mapping, shared read-only mapping) of a reader; see the module docstring."""
    shared = _Mapping(fd, size)
    try:
        private = _Mapping(fd, size, writable=True, private=True)
    except OSError:  # strict overcommit charges a writable private mapping in full: fall back to read-only
        private = shared
    return private, shared


def open_segment(name: str, *, retries: int = 3) -> Segment:
    """Map store ``name`` as a reader; validate magic, version, state and the manifest's checksum.

    Segments whose owner died are swept first (this one included: then it is reported as gone).
    """
    path = segment_path(name)
    swept = sweep()
    last: Exception | None = None
    for _ in range(max(1, retries)):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            why = swept.removed.get(path.name)
            if why is not None:
                raise FileNotFoundError(f"no shared store named {name!r}: its segment was {why}, so it was "
                                        f"removed") from None
            raise FileNotFoundError(f"no shared store named {name!r} ({path} is absent: is the host running?)") \
                from None
        try:
            size = os.fstat(fd).st_size
            if size < _PAGE:
                raise FormatError(f"shared store {name!r}: segment is {size} bytes, too small to be a store")
            private, shared = _map_reader(fd, size)
        finally:
            os.close(fd)
        page = shared.array(0, _PAGE, writable=False)
        magic, version, state, gen, uid, mlen, mcrc = _HEADER.unpack_from(page, 0)
        if magic != _MAGIC:
            raise FormatError(f"shared store {name!r}: {path} is not an ibpcache segment")
        if version != _VERSION:
            raise FormatError(f"shared store {name!r}: segment version {version}, this build reads {_VERSION}")
        if state in (_STOPPED, _ORPHANED):
            raise FileNotFoundError(f"no shared store named {name!r}: it is being removed (its owner "
                                    f"{'stopped' if state == _STOPPED else 'died'})")
        if state != _READY:  # retired between our open and now: a newer generation is (being) renamed in
            last = StaleStoreError(f"shared store {name!r}: generation {gen} is retired")
            continue
        blob = page[_HEADER.size : _HEADER.size + mlen].tobytes()
        if _crc(blob) != mcrc:
            raise FormatError(f"shared store {name!r}: manifest checksum mismatch")
        man = json.loads(blob)
        if man.get("generation") != gen or man.get("uid") != uid:
            raise FormatError(f"shared store {name!r}: manifest generation {man.get('generation')} does not "
                              f"match the segment header's {gen}")
        views = {}
        for key, (off, nbytes, dt, shape, _) in man["sections"].items():
            if off % _PAGE or off + nbytes > size:
                raise FormatError(f"shared store {name!r}: section {key!r} lies outside the segment")
            views[key] = private.array(off, nbytes, dt, shape, writable=False)
        return Segment(name, path, man, views, owner=False, generation=gen, uid=uid, mapping=private, shared=shared)
    raise last if last is not None else StaleStoreError(f"shared store {name!r} could not be opened")
