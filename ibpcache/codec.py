"""``Codec``: one fitted mask/bitval pair per dataset, and compression of rows with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._validation import as_row_bytes, check_rows, resolve_device
from .errors import FormatError
from .fit import DEFAULT_THRESHOLDS, fit_rows_many, sample_rows
from .format import CHUNK_SIZES, FileKind, Layout, RowGeometry, dtype_to_name, name_to_dtype, read_container, write_container
from .kernels.backends import backend_for
from .kernels import bitpack_cpu as cpu
from .kernels.tables import KernelTables

__all__ = ["Codec"]

_FIT_BATCH_BYTES = 1 << 28  # fit/compress stream CPU rows to the GPU in pieces of this size

_rows_container: "Callable[..., Any] | None" = None
"""What :meth:`Codec.compress` wraps its bytes in: :class:`~ibpcache.compressed.CompressedRows`. That module needs
``Codec`` (its files store one), so it registers itself here when imported, which ``import ibpcache`` always does
before anything can call ``compress``; this module never imports it, so the two modules import one way only."""


def _register_rows_container(make: "Callable[..., Any]") -> None:
    """Set what :meth:`Codec.compress` returns: ``make(codec, data, lengths, layout=..., origin=...)``
    (:mod:`ibpcache.compressed` registers ``CompressedRows`` at import)."""
    global _rows_container
    _rows_container = make


class Codec:
    """The metadata IBP keeps once per dataset (a few KB): which bits are invariant, and their values.

    ``mask[j]`` / ``bitval[j]`` (uint64, low ``chunk_bytes * 8`` bits used) describe chunk position j of
    every row. Rows are ``row_bytes`` bytes of ``dtype`` elements shaped ``row_shape``.
    """

    def __init__(
        self,
        mask: np.ndarray,
        bitval: np.ndarray,
        *,
        chunk_bytes: int,
        row_bytes: int,
        dtype: torch.dtype,
        row_shape: tuple[int, ...],
        threshold: float,
        fitted_rows: int = 0,
        scores: "dict | None" = None,
    ) -> None:
        self.geometry = RowGeometry(int(row_bytes), int(chunk_bytes))
        mask = np.ascontiguousarray(mask, dtype=np.uint64)
        bitval = np.ascontiguousarray(bitval, dtype=np.uint64)
        n = self.geometry.n_chunks
        if mask.shape != (n,) or bitval.shape != (n,):
            raise FormatError(f"mask/bitval must have {n} entries for {row_bytes}-byte rows of {chunk_bytes}-byte "
                              f"chunks, got {mask.shape} and {bitval.shape}")
        width = np.uint64((1 << (8 * chunk_bytes)) - 1)
        if np.any(mask & ~width) or np.any(bitval & ~mask):
            raise FormatError("bitval must be a subset of mask and both must fit the chunk width")
        row_elems = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
        if row_elems * torch.empty((), dtype=dtype).element_size() != row_bytes:
            raise FormatError(f"row_shape {row_shape} of {dtype} is not {row_bytes} bytes")
        self.mask = mask
        self.bitval = bitval
        self.dtype = dtype
        self.row_shape = tuple(int(s) for s in row_shape)
        self.threshold = float(threshold)
        self.fitted_rows = int(fitted_rows)
        self.scores = dict(scores or {})
        self._device_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kernel_tables: dict[str, KernelTables] = {}

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        return self.geometry.row_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.geometry.chunk_bytes

    @property
    def n_chunks(self) -> int:
        return self.geometry.n_chunks

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of mask + bitval (what lives on the GPU once per dataset)."""
        return int(self.mask.nbytes + self.bitval.nbytes)

    def __repr__(self) -> str:
        saved = int(sum(bin(int(m)).count("1") for m in self.mask))
        return (f"Codec(dtype={dtype_to_name(self.dtype)}, row_shape={self.row_shape}, row_bytes={self.row_bytes}, "
                f"chunk_bytes={self.chunk_bytes}, threshold={self.threshold:.2f}, invariant_bits={saved})")

    def device_tables(self, device: "str | torch.device") -> tuple[torch.Tensor, torch.Tensor]:
        """mask and bitval as int64 tensors on ``device`` (uploaded once, then cached)."""
        dev = torch.device(device)
        key = str(dev)
        if key not in self._device_tables:
            m = torch.from_numpy(self.mask.view(np.int64).copy()).to(dev)
            b = torch.from_numpy(self.bitval.view(np.int64).copy()).to(dev)
            self._device_tables[key] = (m, b)
        return self._device_tables[key]

    def kernel_tables(self, device: "str | torch.device") -> KernelTables:
        """What a kernel launch on ``device`` needs (mask/bitval there + geometry), built once per device.

        The launchers in ``ibpcache.kernels`` take this plain record rather than the codec, so the kernels
        never import the codec layer.
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        if key not in self._kernel_tables:
            mask, bitval = self.device_tables(dev)
            self._kernel_tables[key] = KernelTables(mask=mask, bitval=bitval, chunk_bytes=self.chunk_bytes,
                                                    n_chunks=self.n_chunks, row_bytes=self.row_bytes)
        return self._kernel_tables[key]

    # -- fit --------------------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        x: torch.Tensor,
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str" = "auto",
        sample: "float | int | None" = None,
        *,
        thresholds: "tuple[float, ...]" = DEFAULT_THRESHOLDS,
        seed: int = 0,
        method: str = "ibp",
    ) -> "Codec":
        """Learn mask/bitval from ``x`` ([N, ...], CPU or CUDA; runs where ``x`` lives).

        ``method``: ``"ibp"`` (this codec, the default), ``"raw"`` (an IBP codec with an empty mask: every row
        stored as is), ``"exponent"`` (bf16/fp16 only: :class:`~ibpcache.exponent.ExponentCodec`, Huffman-coded
        exponents; CPU reference so far, the stores and GPU kernels take IBP codecs only) or ``"auto"`` (of
        those that apply, the one that stores ``x`` in the fewest bytes).

        One pass counts set bits per bit position; one more scores every candidate threshold
        (``thresholds``, default T/N = 0.70..0.95) and chunk size in {1, 2, 4, 8}, and the smallest total
        wins. ``threshold``/``chunk_bytes`` pin one value instead of "auto". ``sample`` fits on a
        fraction (float) or a count (int) of randomly chosen rows (paper Table 5: 10% loses ~nothing).
        A non-contiguous ``x`` (a slice, a transpose) is accepted: the rows fitted on (the sample, if any) are
        copied once into a transient contiguous tensor.
        """
        if method not in ("ibp", "raw", "exponent", "auto"):
            raise ValueError(f"method must be 'ibp', 'raw', 'exponent' or 'auto', got {method!r}")
        if method == "raw":
            return cls.raw(x.dtype, tuple(x.shape[1:]))
        if method == "exponent":
            from .exponent import ExponentCodec

            return ExponentCodec.fit(x)  # type: ignore[return-value]
        ibp = cls.fit_many([x], threshold, chunk_bytes, sample, thresholds=thresholds, seed=seed)[0]
        if method == "ibp":
            return ibp
        return cls._smallest(x, ibp)

    @classmethod
    def _smallest(cls, x: torch.Tensor, ibp: "Codec") -> "Codec":
        """``method='auto'``: IBP, exponent coding (16-bit floats) or raw, whichever stores ``x`` in fewer bytes."""
        from .exponent import FORMATS, ExponentCodec

        best, size = cls.raw(x.dtype, tuple(x.shape[1:])), x.shape[0] * ibp.row_bytes
        ibp_size = int(ibp.stored_lengths(x).sum(dtype=torch.int64))
        if ibp_size < size:
            best, size = ibp, ibp_size
        if x.dtype in FORMATS:
            exp = ExponentCodec.fit(x)
            if int(exp.stored_lengths(x).sum(dtype=torch.int64)) < size:
                best = exp  # type: ignore[assignment]
        return best

    @classmethod
    def raw(cls, dtype: torch.dtype, row_shape: tuple[int, ...]) -> "Codec":
        """A codec with an all-zero mask: every row is stored raw, through the same formats and kernels."""
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        chunk = next(c for c in (8, 4, 2, 1) if row_bytes % c == 0)
        zeros = np.zeros(row_bytes // chunk, dtype=np.uint64)
        return cls(zeros, zeros.copy(), chunk_bytes=chunk, row_bytes=row_bytes, dtype=dtype,
                   row_shape=tuple(row_shape), threshold=1.0)

    @classmethod
    def fit_many(
        cls,
        xs: "list[torch.Tensor]",
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str | list[int | str]" = "auto",
        sample: "float | int | None" = None,
        *,
        thresholds: "tuple[float, ...]" = DEFAULT_THRESHOLDS,
        seed: int = 0,
    ) -> "list[Codec]":
        """One codec per tensor of ``xs`` (all on the same device), fitted together: same result as
        :meth:`fit` on each, but on the GPU with two host syncs in all instead of two per codec.

        ``chunk_bytes`` may be one value for all or a list with one value per tensor.
        """
        if not xs:
            return []
        chunk_list = list(chunk_bytes) if isinstance(chunk_bytes, (list, tuple)) else [chunk_bytes] * len(xs)
        if len(chunk_list) != len(xs):
            raise ValueError(f"chunk_bytes: expected {len(xs)} values, got {len(chunk_list)}")
        rows_list, sizes_list = [], []
        for x, chunk in zip(xs, chunk_list):
            idx = None
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and not x.is_contiguous():
                # gather the sample first: a strided x is then copied only for the sampled rows
                idx = sample_rows(x.shape[0], sample, seed)
                x = x[torch.from_numpy(idx).to(x.device)] if idx is not None else x
            x = check_rows(x)  # copies a strided x once (transient; the fit reads every row anyway)
            dtype_to_name(x.dtype)
            if x.shape[0] == 0:
                raise ValueError("cannot fit a codec on zero rows")
            rows = as_row_bytes(x)
            if idx is None:
                idx = sample_rows(rows.shape[0], sample, seed)
                if idx is not None:
                    rows = rows[torch.from_numpy(idx).to(rows.device)]
            rows_list.append(rows)
            sizes_list.append(cls._fit_sizes_arg(chunk))
        if len({r.device for r in rows_list}) != 1:
            raise ValueError("fit_many: every tensor must be on the same device")
        grid = cls._fit_grid_arg(threshold, thresholds)
        results = fit_rows_many(rows_list, thresholds=grid, chunk_sizes=sizes_list, backend=backend_for(rows_list[0]))
        return [cls(r.mask, r.bitval, chunk_bytes=r.chunk_bytes, row_bytes=rows.shape[1], dtype=x.dtype,
                    row_shape=tuple(x.shape[1:]), threshold=r.threshold, fitted_rows=r.fitted_rows, scores=r.scores)
                for r, rows, x in zip(results, rows_list, xs)]

    @staticmethod
    def _fit_grid_arg(threshold: "float | str", thresholds: "tuple[float, ...]") -> "tuple[float, ...]":
        if threshold == "auto":
            return tuple(thresholds)
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            if not 0.5 < float(threshold) <= 1.0:
                raise ValueError(f"threshold must be in (0.5, 1.0] or 'auto', got {threshold}")
            return (float(threshold),)
        raise ValueError(f"threshold must be a number or 'auto', got {threshold!r}")

    @staticmethod
    def _fit_sizes_arg(chunk_bytes: "int | str") -> "tuple[int, ...]":
        if chunk_bytes == "auto":
            return CHUNK_SIZES
        if chunk_bytes in CHUNK_SIZES:
            return (int(chunk_bytes),)
        raise ValueError(f"chunk_bytes must be one of {CHUNK_SIZES} or 'auto', got {chunk_bytes!r}")

    # -- compress ---------------------------------------------------------------------------------
    def _check_compatible(self, x: torch.Tensor) -> torch.Tensor:
        x = check_rows(x)
        if x.dtype != self.dtype:
            raise TypeError(f"x: expected dtype {self.dtype} (the codec's), got {x.dtype}")
        if tuple(x.shape[1:]) != self.row_shape:
            raise ValueError(f"x: expected rows of shape {self.row_shape}, got {tuple(x.shape[1:])}")
        return as_row_bytes(x)

    def stored_lengths(self, x: torch.Tensor) -> torch.Tensor:
        """int32 [N]: stored bytes per row of ``x`` under this codec (row_bytes for raw rows)."""
        rows = self._check_compatible(x)
        if rows.is_cuda:
            from .kernels.bitpack import size_rows

            return size_rows(rows, self.kernel_tables(rows.device))
        return torch.from_numpy(cpu.size_rows_cpu(rows.numpy(), self.mask, self.bitval, self.chunk_bytes))

    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        """CPU: int32 stored bytes of each row of ``rows_u8`` (uint8 [M, row_bytes]); ``row_bytes`` where raw.

        Stores that place rows back to back need the lengths before they encode (same method on
        :class:`~ibpcache.exponent.ExponentCodec`)."""
        return cpu.size_rows_cpu(rows_u8, self.mask, self.bitval, self.chunk_bytes)

    def encode_rows_at(self, rows_u8: np.ndarray, buf: np.ndarray, offsets: np.ndarray,
                       lengths: "np.ndarray | None" = None) -> np.ndarray:
        """CPU: store row m of ``rows_u8`` (uint8 [M, row_bytes]) at ``buf[offsets[m]:]``; return int32 lengths.

        Each row is written compressed when that shrinks it, raw otherwise; exactly ``lengths[m]`` bytes are
        written (pass ``lengths`` if they are already known). The one CPU write path of every store.
        """
        if lengths is None:
            lengths = cpu.size_rows_cpu(rows_u8, self.mask, self.bitval, self.chunk_bytes)
        if rows_u8.shape[0]:
            cpu.encode_rows_cpu(rows_u8, self.mask, self.bitval, self.chunk_bytes, buf, offsets, lengths)
        return lengths

    def decode_rows_at(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out_u8: np.ndarray,
                       out_rows: np.ndarray, compressed: "np.ndarray | None" = None) -> None:
        """CPU: decode the row stored at ``buf[offsets[m]:]`` (``lengths[m]`` bytes) into ``out_u8[out_rows[m]]``.

        ``compressed`` (uint8 per row) defaults to ``lengths < row_bytes``, which is what the format implies.
        The one CPU read path of every store.
        """
        if compressed is None:
            compressed = (lengths < self.row_bytes).astype(np.uint8)
        cpu.decode_rows_cpu(buf, offsets, lengths, compressed, self.mask, self.bitval, self.chunk_bytes, out_u8,
                            out_rows)

    def compress(
        self,
        x: torch.Tensor,
        layout: "str | Layout" = "inplace",
        pin: bool = True,
        device: "str | torch.device | None" = None,
    ) -> Any:
        """Compress every row of ``x`` into a :class:`~ibpcache.compressed.CompressedRows` that lives in host memory
        (pinned when CUDA exists and ``pin``).

        Runs on the GPU when ``x`` is a CUDA tensor or ``device='cuda'`` (CPU rows then stream to the GPU
        in pieces, so datasets larger than GPU memory work), otherwise with the Numba CPU encoder. Both
        produce identical bytes. A non-contiguous ``x`` (a slice, a transpose) is copied once with
        ``.contiguous()`` before encoding; the copy is transient, the result is a new buffer either way.
        """
        if _rows_container is None:  # only if ibpcache/__init__ stopped importing ibpcache.compressed
            raise RuntimeError("Codec.compress: ibpcache.compressed has not registered CompressedRows")
        layout = Layout.from_str(layout)
        rows = self._check_compatible(x)
        run_dev = rows.device if rows.is_cuda else resolve_device(device)
        pin = bool(pin) and torch.cuda.is_available()
        if run_dev.type == "cuda":
            from .kernels.bitpack import compress_rows_gpu

            # the GPU compress_rows_gpu streams through: the rows' own, or the current one for CPU rows
            gpu = rows.device if rows.is_cuda else torch.device("cuda", torch.cuda.current_device())
            data, lengths = compress_rows_gpu(rows, self.kernel_tables(gpu), layout is Layout.PACKED, pin,
                                              _FIT_BATCH_BYTES)
        else:
            data, lengths = _compress_rows_cpu(rows, self, layout, pin)
        return _rows_container(self, data, lengths, layout=layout, origin=str(x.device.type))

    # -- persistence ------------------------------------------------------------------------------
    def header(self) -> dict:
        return {
            "dtype": dtype_to_name(self.dtype),
            "row_shape": list(self.row_shape),
            "row_bytes": self.row_bytes,
            "chunk_bytes": self.chunk_bytes,
            "threshold": self.threshold,
            "fitted_rows": self.fitted_rows,
        }

    @classmethod
    def from_header(cls, hdr: dict, mask: np.ndarray, bitval: np.ndarray) -> "Codec":
        try:
            return cls(mask, bitval, chunk_bytes=int(hdr["chunk_bytes"]), row_bytes=int(hdr["row_bytes"]),
                       dtype=name_to_dtype(hdr["dtype"]), row_shape=tuple(hdr["row_shape"]),
                       threshold=float(hdr["threshold"]), fitted_rows=int(hdr.get("fitted_rows", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"bad codec header: {exc}") from None

    def save(self, path: "str | Path") -> None:
        """Write the codec (mask, bitval, geometry) to a self-describing, checksummed file."""
        write_container(path, FileKind.CODEC, self.header(), [self.mask, self.bitval])

    @classmethod
    def load(cls, path: "str | Path") -> "Codec":
        """Read a file written by :meth:`save`; corrupt or truncated files raise FormatError."""
        hdr, sections = read_container(path, FileKind.CODEC)
        if hdr.get("method", "ibp") == "exponent":  # files without a method are IBP (all earlier files)
            from .exponent import ExponentCodec

            return ExponentCodec.from_header(hdr, sections)  # type: ignore[return-value]
        if len(sections) != 2:
            raise FormatError(f"{path}: expected 2 sections (mask, bitval), found {len(sections)}")
        return cls.from_header(hdr, sections[0].astype(np.uint64), sections[1].astype(np.uint64))

    def same_tables(self, other: "Codec") -> bool:
        return (self.geometry == other.geometry and np.array_equal(self.mask, other.mask)
                and np.array_equal(self.bitval, other.bitval))


def _alloc_host(nbytes: int, pin: bool) -> torch.Tensor:
    """Zeroed host buffer (pinned for zero-copy GPU reads when asked).

    16 spare bytes past the end: decoders read whole aligned 16-byte blocks, so the last row's final block may
    reach past ``nbytes`` (never past the allocation).
    """
    buf = torch.zeros(nbytes + 16, dtype=torch.uint8, pin_memory=pin)
    return buf[:nbytes]


def _compress_rows_cpu(rows: torch.Tensor, codec: Codec, layout: Layout, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    src = rows.numpy()
    lengths = cpu.size_rows_cpu(src, codec.mask, codec.bitval, codec.chunk_bytes)
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
