"""``CompressedRows``: a dataset's rows stored by one codec (IBP, exponent or raw) in host memory, with
gather/decompress, save/load and shared-memory publishing; and :func:`compress_rows`, what ``Codec.compress`` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ._validation import OUT_CONTIGUOUS_WHY, check_ids, resolve_device
from .codec import Codec, check_codec, set_compressor
from .errors import FormatError, InvalidArgumentError
from . import _shm
from .format import FileKind, Layout, read_container, write_container

__all__ = ["CompressedRows", "compress_rows"]

_BATCH_BYTES = 1 << 28  # a GPU compress streams CPU rows to the GPU in pieces of this size


def _alloc_host(nbytes: int, pin: bool) -> torch.Tensor:
    """Zeroed host buffer (pinned for zero-copy GPU reads when asked).

    16 spare bytes past the end: decoders read whole aligned 16-byte blocks, so the last row's final block may
    reach past ``nbytes`` (never past the allocation).
    """
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, pin_memory=pin)
    return buf[:nbytes]


def _compress_cpu(codec: Codec, rows: torch.Tensor, layout: Layout, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    src = rows.numpy()
    lengths = codec.row_lengths(src)
    n, row_bytes = src.shape
    if layout is Layout.INPLACE:
        offsets = np.arange(n, dtype=np.int64) * row_bytes
        total = n * row_bytes
    else:
        offsets = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        total = int(lengths.sum(dtype=np.int64))
    data = _alloc_host(total, pin)
    codec.encode_rows_at(src, data.numpy(), offsets, lengths)
    return data, torch.from_numpy(lengths)


def _compress_gpu(codec: Codec, rows: torch.Tensor, packed: bool, pin: bool,
                  batch_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress on the GPU into host memory; CPU rows stream through the GPU in ``batch_bytes`` pieces.

    With ``pin`` the encoder writes straight into pinned host memory (zero-copy); otherwise it encodes into a
    device buffer that is copied out per batch. The packed layout sizes every row first (one pass), then places
    the rows back to back. Returns ``(data, lengths)`` on the host (one sync at the end).
    """
    n, rb = rows.shape
    dev = rows.device if rows.is_cuda else torch.device("cuda", torch.cuda.current_device())
    step = max(1, batch_bytes // max(rb, 1))

    def batches():
        for a in range(0, n, step):
            b = min(n, a + step)
            chunk = rows[a:b]
            yield a, b, (chunk if chunk.is_cuda else chunk.to(dev, non_blocking=chunk.is_pinned()))

    lengths = torch.empty(n, dtype=torch.int32, device=dev)
    if packed:
        for a, b, chunk in batches():
            lengths[a:b] = codec.size_rows_gpu(chunk)
        offsets = torch.cumsum(lengths.to(torch.int64), 0) - lengths.to(torch.int64)
        total = int(lengths.sum(dtype=torch.int64)) if n else 0
    else:
        offsets = torch.arange(n, dtype=torch.int64, device=dev) * rb
        total = n * rb
    data = _alloc_host(total, pin)
    if pin:
        for a, b, chunk in batches():
            codec.encode_rows_gpu(chunk, offsets[a:b] + data.data_ptr(), lengths[a:b])
    else:
        for a, b, chunk in batches():
            lo = int(offsets[a]) if packed else a * rb
            hi = (int(offsets[b - 1]) + int(lengths[b - 1])) if packed else b * rb
            stage = torch.zeros(hi - lo + 16, dtype=torch.uint8, device=dev)
            codec.encode_rows_gpu(chunk, offsets[a:b] - lo + stage.data_ptr(), lengths[a:b])
            data[lo:hi].copy_(stage[: hi - lo])
    torch.cuda.current_stream(dev).synchronize()
    return data, lengths.cpu()


def compress_rows(codec: Codec, x: torch.Tensor, layout: "str | Layout" = "inplace", pin: bool = True,
                  device: "str | torch.device | None" = None) -> "CompressedRows":
    """Every row of ``x`` stored by ``codec`` (any method) in host memory: :meth:`Codec.compress`.

    Runs on the GPU when ``x`` is a CUDA tensor or ``device='cuda'`` (CPU rows then stream to the GPU in pieces,
    so datasets larger than GPU memory work), otherwise on the CPU (Numba); both write identical bytes. A strided
    ``x`` is copied once with ``.contiguous()`` (transient). ``pin``: pinned host memory when CUDA exists.
    """
    check_codec(codec)
    layout = Layout.from_str(layout)
    rows = codec.check_compatible(x)
    run_dev = rows.device if rows.is_cuda else resolve_device(device)
    pin = bool(pin) and torch.cuda.is_available()
    if run_dev.type == "cuda":
        data, lengths = _compress_gpu(codec, rows, layout is Layout.PACKED, pin, _BATCH_BYTES)
    else:
        data, lengths = _compress_cpu(codec, rows, layout, pin)
    return CompressedRows(codec, data, lengths, layout=layout, origin=str(x.device.type))


set_compressor(compress_rows)


def _contiguous_bytes(data: torch.Tensor) -> torch.Tensor:
    """A strided ``data`` copied once into a fresh buffer (pinned if it was) with the 16 spare bytes decoders
    may read past the end; construction-time only, the GPU kernels then read the copy by address."""
    pin = data.device.type == "cpu" and data.is_pinned()
    buf = torch.empty(data.numel() + 16, dtype=data.dtype, device=data.device, pin_memory=pin)
    buf[data.numel():].zero_()
    buf = buf[: data.numel()]
    buf.copy_(data.reshape(-1))
    return buf.view(data.shape)


def _flags_from_lengths(lengths: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """1 bit per row (LSB-first within each byte): set when the row is stored compressed."""
    bits = (lengths.numpy() < row_bytes).astype(np.uint8)
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def _readonly_tensor(arr: np.ndarray) -> torch.Tensor:
    """A CPU tensor viewing a read-only numpy array (a shared-store section) without copying it.

    torch has no read-only tensors; it warns once about that, which we silence because no write through such a
    tensor lands in the shared store: an attached store's tensors view a private copy-on-write mapping (see
    ``ibpcache._shm``); only the GPU's view (``host_data_for_gpu``) is the shared read-only mapping, which nothing
    in ibpcache writes (an adopted host store refuses write-back).
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if arr.size == 0:
            return torch.from_numpy(arr.copy())
        return torch.frombuffer(arr, dtype=_TORCH_DTYPES[arr.dtype.str[1:]]).reshape(arr.shape)


_TORCH_DTYPES = {"u1": torch.uint8, "i4": torch.int32, "i8": torch.int64}


class CompressedRows:
    """Every row of a dataset stored by one :class:`~ibpcache.codec.Codec` (IBP, exponent or raw).

    ``data`` (uint8, host; pinned when CUDA exists; a strided tensor is copied once into a fresh buffer at
    construction) holds the stored rows: in the ``inplace`` layout
    row i at ``i * row_bytes``, in the ``packed`` layout back to back at ``offsets[i]``. ``lengths`` (int32)
    gives each row's stored bytes (``row_bytes`` for a raw row) so reads are bounded, and ``flags`` is
    the paper's 1-bit-per-row "is compressed" bitmask.
    """

    def __init__(self, codec: Codec, data: torch.Tensor, lengths: torch.Tensor, *, layout: "str | Layout",
                 origin: str = "cpu") -> None:
        self.codec = check_codec(codec)
        self.layout = Layout.from_str(layout)
        if isinstance(data, torch.Tensor) and not data.is_contiguous():
            data = _contiguous_bytes(data)
        self.data = data
        self.lengths = lengths.to(torch.int32).contiguous()
        n = self.lengths.numel()
        rb = codec.row_bytes
        self.flags = _flags_from_lengths(self.lengths, rb)
        if self.layout is Layout.INPLACE:
            self.offsets = torch.arange(n, dtype=torch.int64) * rb
            expected = n * rb
        else:
            self.offsets = torch.zeros(n, dtype=torch.int64)
            if n > 1:
                torch.cumsum(self.lengths[:-1].to(torch.int64), 0, out=self.offsets[1:])
            expected = int(self.lengths.sum(dtype=torch.int64))
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != expected:
            raise FormatError(f"data must be a 1-D uint8 tensor of {expected} bytes for this layout, "
                              f"got {data.dtype} of shape {tuple(data.shape)}")
        if n and (int(self.lengths.min()) < 1 or int(self.lengths.max()) > rb):
            raise FormatError(f"row lengths must lie in [1, {rb}]")
        self.origin = origin
        self._device_meta: dict[str, dict[str, torch.Tensor]] = {}
        self.shared: "_shm.Segment | None" = None  # set by attach(): the segment the bytes live in
        self._gpu_data: "torch.Tensor | None" = None  # attached: the payload as the GPU reads it (host_data_for_gpu)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return int(self.lengths.numel())

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_rows, *self.codec.row_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.codec.dtype

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes

    @property
    def raw_nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Compressed row bytes (what crosses PCIe for a full read); metadata excluded, as in the paper."""
        return int(self.lengths.sum(dtype=torch.int64))

    @property
    def metadata_nbytes(self) -> int:
        """The codec's tables + 1-bit flags + per-row lengths (+ offsets in the packed layout)."""
        extra = self.offsets.numel() * 8 if self.layout is Layout.PACKED else 0
        return self.codec.metadata_nbytes + self.flags.numel() + self.lengths.numel() * 4 + extra

    @property
    def host_nbytes(self) -> int:
        """Host memory the stored rows occupy (inplace keeps every row's full slot)."""
        return int(self.data.numel())

    @property
    def ratio(self) -> float:
        """Raw bytes / compressed row bytes (paper definition; metadata excluded)."""
        return self.raw_nbytes / max(self.nbytes, 1)

    @property
    def stored_ratio(self) -> float:
        """Raw bytes / (compressed row bytes + :attr:`metadata_nbytes`): what holding the rows really costs."""
        return self.raw_nbytes / max(self.nbytes + self.metadata_nbytes, 1)

    @property
    def compressed_fraction(self) -> float:
        return float((self.lengths < self.row_bytes).float().mean()) if self.n_rows else 0.0

    def is_compressed(self) -> torch.Tensor:
        """uint8 [N]: 1 where the row is stored compressed."""
        return (self.lengths < self.row_bytes).to(torch.uint8)

    def __repr__(self) -> str:
        return (f"CompressedRows(n_rows={self.n_rows}, row_shape={self.codec.row_shape}, dtype={self.dtype}, "
                f"layout={self.layout.value}, ratio={self.ratio:.3f}, nbytes={self.nbytes})")

    # -- device copies of the small per-row tables ------------------------------------------------
    def device_meta(self, device: "str | torch.device") -> dict[str, torch.Tensor]:
        """lengths / flags / offsets on ``device`` (uploaded once; the GPU fetch kernels read these)."""
        dev = torch.device(device)
        key = str(dev)
        if key not in self._device_meta:
            meta = {"lengths": self.lengths.to(dev), "flags": self.flags.to(dev)}
            if self.layout is Layout.PACKED:
                meta["offsets"] = self.offsets.to(dev)
            self._device_meta[key] = meta
        return self._device_meta[key]

    def host_data_for_gpu(self) -> torch.Tensor:
        """The stored bytes, pinned so GPU warps can read them zero-copy (pins a copy once if needed).

        An attached shared store is never copied: its shared read-only mapping is page-locked in place
        (``cudaHostRegister``, mapped + read-only, once per process) and the result views the payload there, not
        through ``self.data`` (a private copy-on-write mapping; see ``ibpcache._shm`` for why the GPU must not
        pin that one).
        """
        if self.shared is not None:
            if self._gpu_data is None:
                self._gpu_data = _readonly_tensor(self.shared.gpu_view("data"))
            return self._gpu_data
        if not self.data.is_pinned():
            self.data = self.data.pin_memory()
        return self.data

    # -- shared memory ----------------------------------------------------------------------------
    def share(self, name: str, *, replace: bool = True) -> "_shm.Segment":
        """Publish these rows in POSIX shared memory as store ``name`` (mode 0600) and return its handle.

        Other processes of this user then :meth:`attach` it with no copy. The store lives as long as the handle:
        ``handle.close()``/``unlink()``, dropping the handle and a normal exit of this process remove it (readers
        raise StaleStoreError on their next use); if this process dies without that (kill -9, an OOM kill), the
        next ``share``/``attach`` on the machine, or ``python -m ibpcache task=gc``, removes it. Re-sharing under
        the same name publishes a new generation and retires the old one.
        """
        manifest = {"kind": "ibpcache.CompressedRows", "codec": self.codec.header(), "layout": self.layout.value,
                    "n_rows": self.n_rows}
        sections = dict(zip(self.codec.section_names, self.codec.sections()))
        sections.update({"lengths": self.lengths.numpy(), "flags": self.flags.numpy(), "offsets": self.offsets.numpy(),
                         "data": self.data.numpy()})
        return _shm.publish(name, manifest, sections, replace=replace)

    @classmethod
    def attach(cls, name: str, *, verify: bool = False) -> "CompressedRows":
        """Map shared store ``name``, with no copy of its payload or per-row tables.

        The result is an ordinary ``CompressedRows`` (FeatureCache, HostStore and the DGL adapter take it)
        whose tensors view the mapping. They view it copy-on-write: a write into them (``rows.data[0] = 1``)
        changes a private copy of that page in this process only and raises nothing; the shared bytes, which
        other processes and this process's GPU read, stay as published (the numpy views in ``rows.shared.sections``
        refuse writes; under strict overcommit the mapping is read-only instead, see ``ibpcache._shm``).
        Every :meth:`gather`/fetch first checks, with a few loads, that the store was not replaced, stopped or
        orphaned since (else :class:`~ibpcache._shm.StaleStoreError`). ``verify=True`` also re-checks every
        section's CRC32 (reads the whole payload once). Attaching never removes a live store; it first sweeps
        away segments whose owner died.
        """
        seg = _shm.open_segment(name)
        try:
            man = seg.manifest
            if man.get("kind") != "ibpcache.CompressedRows":
                raise FormatError(f"shared store {name!r} holds {man.get('kind')!r}, not CompressedRows")
            if verify:
                seg.verify_payload()
            v = seg.sections
            codec = _codec_from(man["codec"], lambda names: [v[k].copy() for k in names])
            self = cls.__new__(cls)
            self.codec = codec
            self.layout = Layout.from_str(man["layout"])
            self.data = _readonly_tensor(v["data"])
            self.lengths = _readonly_tensor(v["lengths"])
            self.flags = _readonly_tensor(v["flags"])
            self.offsets = _readonly_tensor(v["offsets"])
            self.origin = "cpu"
            self._device_meta = {}
            self.shared = seg
            self._gpu_data = None
            self._check_attached(int(man.get("n_rows", -1)))
        except BaseException:
            seg.close()
            raise
        return self

    def _check_attached(self, n_rows: int) -> None:
        """Sizes of an attached store agree with each other (the CRC'd manifest was written by share())."""
        n, rb = self.lengths.numel(), self.row_bytes
        expected = n * rb if self.layout is Layout.INPLACE else self.nbytes
        if (n != n_rows or self.lengths.dtype != torch.int32 or self.offsets.numel() != n
                or self.flags.numel() != (n + 7) // 8 or self.data.numel() != expected):
            raise FormatError(f"shared store {self.shared.name!r}: section sizes do not match its manifest")

    def check_shared(self) -> None:
        """No-op for private rows; for an attached store raise StaleStoreError if it was replaced/stopped."""
        if self.shared is not None:
            self.shared.check()

    # -- reads ------------------------------------------------------------------------------------
    def decompress(self, device: "str | torch.device | None" = None) -> torch.Tensor:
        """All rows, bit-identical to the compressed input (on its device unless ``device`` says otherwise)."""
        dev = resolve_device(device if device is not None else self.origin)
        ids = torch.arange(self.n_rows, dtype=torch.int64, device=dev)
        self.check_shared()
        return self._gather_valid(ids, dev, None)

    def gather(self, ids: torch.Tensor, device: "str | torch.device" = "cuda",
               out: "torch.Tensor | None" = None) -> torch.Tensor:
        """Rows ``x[ids]`` (ids: 1-D int64; any order, duplicates fine) decoded on ``device``.

        On CUDA one fused kernel reads each selected row from pinned host memory (zero-copy), decodes it
        and writes the output; the id check is one reduction on the GPU.
        """
        dev = resolve_device(device)
        ids = check_ids(ids, self.n_rows, dev)
        self.check_shared()
        return self._gather_valid(ids, dev, out)

    def _check_out(self, out: "torch.Tensor | None", m: int, dev: torch.device) -> torch.Tensor:
        shape = (m, *self.codec.row_shape)
        if out is None:
            return torch.empty(shape, dtype=self.dtype, device=dev)
        if not isinstance(out, torch.Tensor) or out.dtype != self.dtype or tuple(out.shape) != shape:
            raise InvalidArgumentError(f"out: expected a {self.dtype} tensor of shape {shape}, got "
                                       f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
        if out.device != dev and not (out.device.type == dev.type == "cuda"):
            raise InvalidArgumentError(f"out: expected device {dev}, got {out.device}")
        if not out.is_contiguous():
            raise InvalidArgumentError(f"out: expected a contiguous tensor, got strides {out.stride()} "
                                       f"({OUT_CONTIGUOUS_WHY})")
        return out

    def _gather_valid(self, ids: torch.Tensor, dev: torch.device, out: "torch.Tensor | None") -> torch.Tensor:
        m = int(ids.numel())
        out = self._check_out(out, m, dev)
        if m == 0:
            return out
        out_u8 = out.view(torch.uint8).reshape(m, self.row_bytes) if out.dim() > 1 else out.view(torch.uint8).reshape(m, -1)
        if dev.type == "cuda":
            meta = self.device_meta(out_u8.device)
            self.codec.gather_rows_gpu(self.host_data_for_gpu(), meta.get("offsets"), meta["lengths"], meta["flags"],
                                       self.n_rows, ids, out_u8)
        else:
            idx = ids.numpy()
            self.codec.decode_rows_at(self.data.numpy(), self.offsets.numpy()[idx], self.lengths.numpy()[idx],
                                      out_u8.numpy(), np.arange(m, dtype=np.int64))
        return out

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: "str | Path") -> None:
        """Write codec (its method and tables), layout, per-row lengths and stored bytes to one checksummed file."""
        hdr = {"codec": self.codec.header(), "layout": self.layout.value, "n_rows": self.n_rows}
        write_container(path, FileKind.ROWS, hdr, [*self.codec.sections(), self.lengths.numpy(), self.data.numpy()])

    @classmethod
    def load(cls, path: "str | Path", pin: bool = True) -> "CompressedRows":
        """Read a file written by :meth:`save`; verifies the checksum and every size before use."""
        hdr, sections = read_container(path, FileKind.ROWS)
        try:
            codec = _codec_from(hdr.get("codec"), lambda names: sections[: len(names)])
        except FormatError as exc:
            raise FormatError(f"{path}: {exc}") from None
        if len(sections) != len(codec.section_names) + 2:
            raise FormatError(f"{path}: expected {len(codec.section_names) + 2} sections, found {len(sections)}")
        lengths, data = sections[len(codec.section_names):]
        if lengths.dtype != np.int32 or int(hdr.get("n_rows", -1)) != lengths.size:
            raise FormatError(f"{path}: row count does not match the header")
        pin = pin and torch.cuda.is_available()
        buf = torch.zeros(data.size + 16, dtype=torch.uint8, pin_memory=pin)[: data.size]  # 16 spare: aligned reads
        buf.copy_(torch.from_numpy(data))
        return cls(codec, buf, torch.from_numpy(lengths.copy()), layout=hdr.get("layout", ""))


def _codec_from(hdr: object, sections_named: "Callable[[tuple[str, ...]], list[np.ndarray]]") -> Codec:
    """The codec a stored header describes (its method picks the class: files without one hold IBP codecs);
    ``sections_named(names)`` returns that class's arrays."""
    if not isinstance(hdr, dict):
        raise FormatError("bad codec header: missing or not a JSON object")
    kind = Codec.kind(str(hdr.get("method", "ibp")))
    return Codec.from_header(hdr, *sections_named(kind.section_names))
