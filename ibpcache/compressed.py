"""``CompressedRows``: a dataset's rows after IBP, in host memory, with gather/decompress and save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ._validation import OUT_CONTIGUOUS_WHY, check_ids, resolve_device
from .codec import Codec, _register_rows_container
from .errors import FormatError
from . import _shm
from .format import FileKind, Layout, read_container, write_container

__all__ = ["CompressedRows"]


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
    """Every row of a dataset compressed with one ``Codec``.

    ``data`` (uint8, host; pinned when CUDA exists; a strided tensor is copied once into a fresh buffer at
    construction) holds the stored rows: in the ``inplace`` layout
    row i at ``i * row_bytes``, in the ``packed`` layout back to back at ``offsets[i]``. ``lengths`` (int32)
    gives each row's stored bytes (``row_bytes`` for a raw row) so reads are bounded, and ``flags`` is
    the paper's 1-bit-per-row "is compressed" bitmask.
    """

    def __init__(self, codec: Codec, data: torch.Tensor, lengths: torch.Tensor, *, layout: "str | Layout",
                 origin: str = "cpu") -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"CompressedRows holds IBP-coded rows (a Codec); got {type(codec).__name__} (the exponent "
                            "codec has no stores or GPU kernels yet: ExponentCodec.encode/decode work on the CPU)")
        self.codec = codec
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
        """mask + bitval + 1-bit flags + per-row lengths (+ offsets in the packed layout)."""
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
        sections = {"mask": self.codec.mask, "bitval": self.codec.bitval, "lengths": self.lengths.numpy(),
                    "flags": self.flags.numpy(), "offsets": self.offsets.numpy(), "data": self.data.numpy()}
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
            codec = Codec.from_header(man["codec"], v["mask"].copy(), v["bitval"].copy())
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
            raise ValueError(f"out: expected a {self.dtype} tensor of shape {shape}, got "
                             f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
        if out.device != dev and not (out.device.type == dev.type == "cuda"):
            raise ValueError(f"out: expected device {dev}, got {out.device}")
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, got strides {out.stride()} ({OUT_CONTIGUOUS_WHY})")
        return out

    def _gather_valid(self, ids: torch.Tensor, dev: torch.device, out: "torch.Tensor | None") -> torch.Tensor:
        m = int(ids.numel())
        out = self._check_out(out, m, dev)
        if m == 0:
            return out
        out_u8 = out.view(torch.uint8).reshape(m, self.row_bytes) if out.dim() > 1 else out.view(torch.uint8).reshape(m, -1)
        if dev.type == "cuda":
            from .kernels.bitpack import gather_rows

            meta = self.device_meta(out_u8.device)
            gather_rows(self.host_data_for_gpu(), meta.get("offsets"), meta["lengths"], meta["flags"], self.n_rows,
                        ids, out_u8, self.codec.kernel_tables(out_u8.device))
        else:
            idx = ids.numpy()
            self.codec.decode_rows_at(self.data.numpy(), self.offsets.numpy()[idx], self.lengths.numpy()[idx],
                                      out_u8.numpy(), np.arange(m, dtype=np.int64))
        return out

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: "str | Path") -> None:
        """Write codec, layout, per-row lengths and stored bytes to one checksummed file."""
        hdr = {"codec": self.codec.header(), "layout": self.layout.value, "n_rows": self.n_rows}
        write_container(path, FileKind.ROWS, hdr, [self.codec.mask, self.codec.bitval, self.lengths.numpy(),
                                                    self.data.numpy()])

    @classmethod
    def load(cls, path: "str | Path", pin: bool = True) -> "CompressedRows":
        """Read a file written by :meth:`save`; verifies the checksum and every size before use."""
        hdr, sections = read_container(path, FileKind.ROWS)
        if len(sections) != 4:
            raise FormatError(f"{path}: expected 4 sections, found {len(sections)}")
        mask, bitval, lengths, data = sections
        codec = Codec.from_header(hdr.get("codec", {}), mask.astype(np.uint64), bitval.astype(np.uint64))
        if lengths.dtype != np.int32 or int(hdr.get("n_rows", -1)) != lengths.size:
            raise FormatError(f"{path}: row count does not match the header")
        pin = pin and torch.cuda.is_available()
        buf = torch.zeros(data.size + 16, dtype=torch.uint8, pin_memory=pin)[: data.size]  # 16 spare: aligned reads
        buf.copy_(torch.from_numpy(data))
        return cls(codec, buf, torch.from_numpy(lengths.copy()), layout=hdr.get("layout", ""))


_register_rows_container(CompressedRows)
