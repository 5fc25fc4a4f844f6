"""Row codecs behind one interface: :class:`Codec` (the contract and the ``fit`` factory), :class:`IBPCodec`
(invariant bit packing), :class:`RawCodec` (rows verbatim); :class:`~ibpcache.exponent.ExponentCodec` (Huffman-coded
exponents) lives in ``exponent.py`` and registers itself here like the other two.

Why one interface: every store (``CompressedRows``, the host store, the caches, the KV append store, saved files,
shared memory) places, encodes and decodes rows by offset and length; which bits a row keeps is the codec's
business only. A codec is fitted once per dataset (a few bytes to a few KB of tables) and then encodes any row of
the same dtype and shape.

This module imports nothing from ``compressed.py``: :meth:`Codec.compress` calls the function ``compressed.py``
installs with :func:`set_compressor` when it is imported (``import ibpcache`` imports both), so the two modules
import one way.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import torch

from ._validation import as_row_bytes, check_rows
from .errors import CodecKindError, FormatError, InternalError, InvalidArgumentError, RowDtypeError, RowShapeError
from .fit import DEFAULT_THRESHOLDS, fit_rows_many, sample_rows
from .format import CHUNK_SIZES, FileKind, RowGeometry, dtype_to_name, name_to_dtype, read_container, write_container
from .kernels.backends import backend_for
from .kernels import bitpack_cpu as cpu
from .kernels.tables import KernelTables

__all__ = ["Codec", "IBPCodec", "RawCodec", "METHODS", "set_compressor", "check_codec"]

METHODS = ("ibp", "exponent", "raw", "auto")
"""What ``Codec.fit(method=...)`` accepts."""

_Compressor = Callable[..., Any]  # returns a compressed.CompressedRows (not imported here, not even for typing)
_compressor: Optional[_Compressor] = None

def set_compressor(fn: _Compressor) -> None:
    """Install the implementation of :meth:`Codec.compress` (``compressed.compress_rows``; called once, by
    ``compressed.py`` at import). Why a hook: the result type lives in ``compressed.py``, which imports this
    module; a call back the other way would make the two import each other."""
    global _compressor
    _compressor = fn


def _row_bytes_of(dtype: torch.dtype, row_shape: tuple[int, ...]) -> int:
    return int(np.prod(row_shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


class Codec(abc.ABC):
    """What every row codec provides; ``Codec.fit(x, method=...)`` builds one.

    The contract, identical for every method:

    * geometry: ``method``, ``dtype``, ``row_shape``, ``row_bytes``; ``metadata_nbytes`` (the tables a store keeps);
    * host (NumPy, Numba): ``row_lengths`` (stored bytes per row, ``row_bytes`` where a row is stored raw),
      ``encode_rows_at`` and ``decode_rows_at`` (rows at arbitrary byte offsets of a buffer);
    * GPU: ``kernel_tables(device)`` (what a launch needs, cached per device), ``size_rows_gpu``,
      ``encode_rows_gpu`` (rows straight to device or pinned host addresses), ``gather_rows_gpu`` (fused gather
      + decode of stored rows);
    * ``compress(x, layout=...) -> CompressedRows``; ``stored_lengths(x)``; ``same_tables``; ``header`` /
      ``save`` / ``load`` (the file records the method; files without one are IBP).

    A stored row is either coded (shorter than ``row_bytes``) or its ``row_bytes`` bytes verbatim: its length
    says which, for every method.

    ``Codec(mask, bitval, chunk_bytes=..., ...)`` builds an :class:`IBPCodec` from its tables (as it always has).
    """

    method: ClassVar[str] = ""
    section_names: ClassVar[tuple[str, ...]] = ()
    """Names of the arrays :meth:`sections` returns (files and shared-memory stores keep them under these)."""
    _kinds: ClassVar[dict[str, type["Codec"]]] = {}

    dtype: torch.dtype
    row_shape: tuple[int, ...]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("method"):
            Codec._kinds[cls.method] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> "Codec":
        return super().__new__(IBPCodec if cls is Codec else cls)

    @classmethod
    def kind(cls, method: str) -> type["Codec"]:
        """The codec class registered for ``method`` ("ibp", "raw", "exponent")."""
        try:
            return cls._kinds[method]
        except KeyError:
            raise FormatError(f"unknown codec method {method!r}; known: {sorted(cls._kinds)}") from None

    # -- geometry ---------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def row_bytes(self) -> int:
        """Bytes of one raw row."""

    @property
    def row_elems(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) if self.row_shape else 1

    @property
    @abc.abstractmethod
    def metadata_nbytes(self) -> int:
        """Bytes of the tables a store keeps once per codec (what decoding needs besides the rows)."""

    # -- host rows --------------------------------------------------------------------------------
    @abc.abstractmethod
    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        """CPU: int32 stored bytes of each row of ``rows_u8`` (uint8 [M, row_bytes]); ``row_bytes`` where raw.

        Stores that place rows back to back need the lengths before they encode."""

    @abc.abstractmethod
    def encode_rows_at(self, rows_u8: np.ndarray, buf: np.ndarray, offsets: np.ndarray,
                       lengths: "np.ndarray | None" = None) -> np.ndarray:
        """CPU: store row m of ``rows_u8`` (uint8 [M, row_bytes]) at ``buf[offsets[m]:]``; return int32 lengths.

        Exactly ``lengths[m]`` bytes are written (pass them if they are already known: :meth:`row_lengths`)."""

    @abc.abstractmethod
    def decode_rows_at(self, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out_u8: np.ndarray,
                       out_rows: np.ndarray, compressed: "np.ndarray | None" = None) -> None:
        """CPU: decode the row stored at ``buf[offsets[m]:]`` (``lengths[m]`` bytes) into ``out_u8[out_rows[m]]``.

        ``compressed`` (uint8 per row) defaults to ``lengths < row_bytes``, which is what every format implies."""

    # -- GPU --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def kernel_tables(self, device: "str | torch.device") -> Any:
        """The tables a kernel launch on ``device`` takes (plain tensors and ints, no codec), built once per device."""

    @abc.abstractmethod
    def size_rows_gpu(self, rows_u8: torch.Tensor) -> torch.Tensor:
        """int32 [M] stored bytes of each row of ``rows_u8`` (CUDA uint8 [M, row_bytes]); no host sync."""

    @abc.abstractmethod
    def encode_rows_gpu(self, rows_u8: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
        """Encode row m of ``rows_u8`` (CUDA) to address ``dst_ptrs[m]`` (device memory, or pinned host memory
        through UVA); ``lengths`` are :meth:`size_rows_gpu`'s. No host sync."""

    @abc.abstractmethod
    def gather_rows_gpu(self, base: torch.Tensor, offsets: "torch.Tensor | None", lengths: torch.Tensor,
                        flags: torch.Tensor, n_rows: int, ids: torch.Tensor, out_u8: torch.Tensor) -> None:
        """Rows ``ids`` (range-checked, on the device) of a store decoded into ``out_u8`` (CUDA uint8 [M, row_bytes]).

        ``base``: the stored bytes (pinned host memory read zero-copy, or device memory); ``offsets`` int64 [n_rows]
        (None: row i at ``i * row_bytes``), ``lengths`` int32 [n_rows] and ``flags`` (1 bit per row, set = coded)
        on the device. Raises FormatError if a stored row is corrupt (methods whose kernels can tell)."""

    # -- tables -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def same_tables(self, other: "Codec") -> bool:
        """True when ``other`` encodes and decodes every row exactly as this codec does."""

    @abc.abstractmethod
    def header(self) -> dict:
        """JSON-able description (``method`` included) that, with :meth:`sections`, rebuilds the codec."""

    @abc.abstractmethod
    def sections(self) -> list[np.ndarray]:
        """The codec's arrays, in the order of :attr:`section_names`."""

    @classmethod
    @abc.abstractmethod
    def _from_sections(cls, hdr: dict, sections: list[np.ndarray]) -> "Codec":
        """Rebuild from :meth:`header` + :meth:`sections` (raise FormatError on anything malformed)."""

    # -- rows in, checked ---------------------------------------------------------------------------
    def check_compatible(self, x: torch.Tensor, name: str = "x") -> torch.Tensor:
        """``x`` as uint8 rows [N, row_bytes] (a view; a strided ``x`` is copied once), after checking that its
        dtype and row shape are this codec's: rows of another dtype or shape would be stored wrong."""
        x = check_rows(x, name)
        if x.dtype != self.dtype:
            raise RowDtypeError(f"{name}: expected dtype {self.dtype} (the codec's), got {x.dtype}")
        if tuple(x.shape[1:]) != self.row_shape:
            raise RowShapeError(f"{name}: expected rows of shape {self.row_shape} (the codec's), got "
                                f"{tuple(x.shape[1:])}")
        return as_row_bytes(x)

    def _check_u8_rows(self, rows_u8: np.ndarray) -> np.ndarray:
        if not isinstance(rows_u8, np.ndarray) or rows_u8.ndim != 2 or rows_u8.dtype != np.uint8:
            raise RowShapeError(f"rows: expected a uint8 [M, {self.row_bytes}] array, got "
                                f"{getattr(rows_u8, 'dtype', type(rows_u8).__name__)} {getattr(rows_u8, 'shape', '')}")
        if rows_u8.shape[1] != self.row_bytes:
            raise RowShapeError(f"rows: expected {self.row_bytes}-byte rows (the codec's), got {rows_u8.shape[1]}")
        return np.ascontiguousarray(rows_u8)

    def stored_lengths(self, x: torch.Tensor) -> torch.Tensor:
        """int32 [N]: stored bytes per row of ``x`` under this codec (``row_bytes`` for raw rows), where ``x`` is."""
        rows = self.check_compatible(x)
        if rows.is_cuda:
            return self.size_rows_gpu(rows)
        return torch.from_numpy(self.row_lengths(rows.numpy()))

    def compress(self, x: torch.Tensor, layout: str = "inplace", pin: bool = True,
                 device: "str | torch.device | None" = None) -> Any:
        """Compress every row of ``x`` into host memory (pinned when CUDA exists and ``pin``): a CompressedRows.

        Runs on the GPU when ``x`` is a CUDA tensor or ``device='cuda'`` (CPU rows then stream to the GPU in
        pieces, so datasets larger than GPU memory work), otherwise on the CPU; both write identical bytes.
        ``layout``: ``"inplace"`` (row i at ``i * row_bytes``) or ``"packed"`` (back to back). A strided ``x`` is
        copied once (transient). Implemented by ``compressed.compress_rows``.
        """
        if _compressor is None:  # compressed.py installs it; `import ibpcache` always imports compressed.py
            raise InternalError("ibpcache.compressed is not imported: import ibpcache first")
        return _compressor(self, x, layout=layout, pin=pin, device=device)

    # -- files ------------------------------------------------------------------------------------
    @classmethod
    def from_header(cls, hdr: dict, *sections: np.ndarray) -> "Codec":
        """The codec ``hdr`` (:meth:`header`) and its ``sections`` describe; the method comes from ``hdr``
        (missing: IBP, as in every file written before codecs had methods)."""
        if not isinstance(hdr, dict):
            raise FormatError(f"bad codec header: expected a JSON object, got {type(hdr).__name__}")
        kind = Codec.kind(str(hdr.get("method", "ibp")))
        names = kind.section_names
        if len(sections) != len(names):
            raise FormatError(f"a {kind.method} codec has {len(names)} section(s) ({', '.join(names) or 'none'}), "
                              f"found {len(sections)}")
        codec = kind._from_sections(hdr, list(sections))
        if not isinstance(codec, cls):
            raise FormatError(f"holds a {kind.method!r} codec, not an {cls.method or 'ibpcache'} codec")
        return codec

    def save(self, path: "str | Path") -> None:
        """Write the codec to a self-describing, checksummed file (``Codec.load`` reads every method)."""
        write_container(path, FileKind.CODEC, self.header(), self.sections())

    @classmethod
    def load(cls, path: "str | Path") -> "Codec":
        """Read a file written by :meth:`save`; corrupt or truncated files raise FormatError. On a subclass
        (``ExponentCodec.load``) a file holding another method is an error too."""
        hdr, sections = read_container(path, FileKind.CODEC)
        try:
            return cls.from_header(hdr, *sections)
        except FormatError as exc:
            raise FormatError(f"{path}: {exc}") from None

    # -- fit (the factory) --------------------------------------------------------------------------
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
        seg: "int | str" = "auto",
        header_budget: "float | None" = None,
    ) -> "Codec":
        """A codec for rows like ``x`` ([N, ...], CPU or CUDA; the fit runs where ``x`` lives).

        ``method``: ``"ibp"`` (:class:`IBPCodec`, the default), ``"exponent"``
        (:class:`~ibpcache.exponent.ExponentCodec`: float32, bfloat16, float16), ``"raw"`` (:class:`RawCodec`) or
        ``"auto"``: of those that take ``x``'s dtype, the one that stores the fitted rows in the fewest bytes,
        tables included (ties: raw, then IBP, then exponent, so a codec must save bytes to be chosen).

        IBP: ``threshold``/``chunk_bytes`` pin one value instead of searching (see :meth:`IBPCodec.fit`). Exponent:
        ``seg`` elements per independently decodable segment (``"auto"``: the most parallel decode whose row
        header costs at most ``header_budget`` of a row, default ``exponent.HEADER_BUDGET`` = 0.75%). ``sample``
        fits on a fraction (float) or a count (int) of randomly chosen rows (``seed``); "auto" compares sizes on
        those rows too.
        """
        if method not in METHODS:
            raise InvalidArgumentError(f"method must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
        if method == "raw":
            x = check_rows(x)
            dtype_to_name(x.dtype)
            return RawCodec(x.dtype, tuple(x.shape[1:]))
        if method == "ibp":
            return IBPCodec.fit(x, threshold, chunk_bytes, sample, thresholds=thresholds, seed=seed)
        exp = Codec.kind("exponent")
        exp_kw = {"seg": seg} if header_budget is None else {"seg": seg, "header_budget": header_budget}
        if method == "exponent":
            return exp.fit(x, sample=sample, seed=seed, **exp_kw)  # type: ignore[call-arg]
        x = check_rows(x)
        idx = sample_rows(int(x.shape[0]), sample, seed)
        if idx is not None:
            x = x[torch.from_numpy(idx).to(x.device)]
        candidates: list[Codec] = [RawCodec(x.dtype, tuple(x.shape[1:])),
                                   IBPCodec.fit(x, threshold, chunk_bytes, thresholds=thresholds)]
        if exp.takes(x.dtype):  # type: ignore[attr-defined]
            candidates.append(exp.fit(x, **exp_kw))  # type: ignore[call-arg]
        sizes = [int(c.stored_lengths(x).sum(dtype=torch.int64)) + c.metadata_nbytes for c in candidates]
        return candidates[min(range(len(candidates)), key=lambda k: (sizes[k], k))]

    @classmethod
    def fit_many(cls, xs: "list[torch.Tensor]", threshold: "float | str" = "auto",
                 chunk_bytes: "int | str | list[int | str]" = "auto", sample: "float | int | None" = None, *,
                 thresholds: "tuple[float, ...]" = DEFAULT_THRESHOLDS, seed: int = 0) -> "list[IBPCodec]":
        """IBP codecs for several tensors fitted together (:meth:`IBPCodec.fit_many`)."""
        return IBPCodec.fit_many(xs, threshold, chunk_bytes, sample, thresholds=thresholds, seed=seed)

    @classmethod
    def raw(cls, dtype: torch.dtype, row_shape: tuple[int, ...]) -> "RawCodec":
        """The :class:`RawCodec` for rows of ``dtype`` shaped ``row_shape``."""
        return RawCodec(dtype, tuple(row_shape))


class IBPCodec(Codec):
    """Invariant bit packing: the bits (nearly) every row shares are stored once per dataset, not per row.

    ``mask[j]`` / ``bitval[j]`` (uint64, low ``chunk_bytes * 8`` bits used) describe chunk position j of every row:
    a row whose chunk matches ``bitval`` on ``mask`` keeps only the other bits (docs/FORMAT.md). Rows are
    ``row_bytes`` bytes of ``dtype`` elements shaped ``row_shape``.
    """

    method = "ibp"
    section_names = ("mask", "bitval")

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
        if _row_bytes_of(dtype, tuple(row_shape)) != row_bytes:
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
        return (f"{type(self).__name__}(dtype={dtype_to_name(self.dtype)}, row_shape={self.row_shape}, "
                f"row_bytes={self.row_bytes}, chunk_bytes={self.chunk_bytes}, threshold={self.threshold:.2f}, "
                f"invariant_bits={saved})")

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
                                                    n_chunks=self.n_chunks, row_bytes=self.row_bytes,
                                                    raw=not bool(np.any(self.mask)))
        return self._kernel_tables[key]

    # -- fit --------------------------------------------------------------------------------------
    @classmethod
    def fit(  # type: ignore[override]
        cls,
        x: torch.Tensor,
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str" = "auto",
        sample: "float | int | None" = None,
        *,
        thresholds: "tuple[float, ...]" = DEFAULT_THRESHOLDS,
        seed: int = 0,
    ) -> "IBPCodec":
        """Learn mask/bitval from ``x`` ([N, ...], CPU or CUDA; runs where ``x`` lives).

        One pass counts set bits per bit position; one more scores every candidate threshold
        (``thresholds``, default T/N = 0.70..0.95) and chunk size in {1, 2, 4, 8}, and the smallest total
        wins. ``threshold``/``chunk_bytes`` pin one value instead of "auto". ``sample`` fits on a
        fraction (float) or a count (int) of randomly chosen rows (paper Table 5: 10% loses ~nothing).
        A non-contiguous ``x`` (a slice, a transpose) is accepted: the rows fitted on (the sample, if any) are
        copied once into a transient contiguous tensor.
        """
        return cls.fit_many([x], threshold, chunk_bytes, sample, thresholds=thresholds, seed=seed)[0]

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
    ) -> "list[IBPCodec]":
        """One codec per tensor of ``xs`` (all on the same device), fitted together: same result as
        :meth:`fit` on each, but on the GPU with two host syncs in all instead of two per codec.

        ``chunk_bytes`` may be one value for all or a list with one value per tensor.
        """
        if not xs:
            return []
        chunk_list = list(chunk_bytes) if isinstance(chunk_bytes, (list, tuple)) else [chunk_bytes] * len(xs)
        if len(chunk_list) != len(xs):
            raise InvalidArgumentError(f"chunk_bytes: expected {len(xs)} values, got {len(chunk_list)}")
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
                raise InvalidArgumentError("cannot fit a codec on zero rows")
            rows = as_row_bytes(x)
            if idx is None:
                idx = sample_rows(rows.shape[0], sample, seed)
                if idx is not None:
                    rows = rows[torch.from_numpy(idx).to(rows.device)]
            rows_list.append(rows)
            sizes_list.append(cls._fit_sizes_arg(chunk))
        if len({r.device for r in rows_list}) != 1:
            raise InvalidArgumentError("fit_many: every tensor must be on the same device")
        grid = cls._fit_grid_arg(threshold, thresholds)
        results = fit_rows_many(rows_list, thresholds=grid, chunk_sizes=sizes_list, backend=backend_for(rows_list[0]))
        return [IBPCodec(r.mask, r.bitval, chunk_bytes=r.chunk_bytes, row_bytes=rows.shape[1], dtype=x.dtype,
                         row_shape=tuple(x.shape[1:]), threshold=r.threshold, fitted_rows=r.fitted_rows,
                         scores=r.scores)
                for r, rows, x in zip(results, rows_list, xs)]

    @staticmethod
    def _fit_grid_arg(threshold: "float | str", thresholds: "tuple[float, ...]") -> "tuple[float, ...]":
        if threshold == "auto":
            return tuple(thresholds)
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            if not 0.5 < float(threshold) <= 1.0:
                raise InvalidArgumentError(f"threshold must be in (0.5, 1.0] or 'auto', got {threshold}")
            return (float(threshold),)
        raise InvalidArgumentError(f"threshold must be a number or 'auto', got {threshold!r}")

    @staticmethod
    def _fit_sizes_arg(chunk_bytes: "int | str") -> "tuple[int, ...]":
        if chunk_bytes == "auto":
            return CHUNK_SIZES
        if chunk_bytes in CHUNK_SIZES:
            return (int(chunk_bytes),)
        raise InvalidArgumentError(f"chunk_bytes must be one of {CHUNK_SIZES} or 'auto', got {chunk_bytes!r}")

    # -- host rows --------------------------------------------------------------------------------
    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        return cpu.size_rows_cpu(self._check_u8_rows(rows_u8), self.mask, self.bitval, self.chunk_bytes)

    def encode_rows_at(self, rows_u8: np.ndarray, buf: np.ndarray, offsets: np.ndarray,
                       lengths: "np.ndarray | None" = None) -> np.ndarray:
        """CPU: store row m of ``rows_u8`` (uint8 [M, row_bytes]) at ``buf[offsets[m]:]``; return int32 lengths.

        Each row is written compressed when that shrinks it, raw otherwise; exactly ``lengths[m]`` bytes are
        written (pass ``lengths`` if they are already known). The one CPU write path of every store.
        """
        rows_u8 = self._check_u8_rows(rows_u8)
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

    # -- GPU --------------------------------------------------------------------------------------
    def size_rows_gpu(self, rows_u8: torch.Tensor) -> torch.Tensor:
        from .kernels.bitpack import size_rows

        return size_rows(rows_u8, self.kernel_tables(rows_u8.device))

    def encode_rows_gpu(self, rows_u8: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
        """IBP's encoder computes each row's length again as it writes (the same values) into ``lengths``."""
        from .kernels.bitpack import encode_into

        encode_into(rows_u8, dst_ptrs, lengths, self.kernel_tables(rows_u8.device))

    def gather_rows_gpu(self, base: torch.Tensor, offsets: "torch.Tensor | None", lengths: torch.Tensor,
                        flags: torch.Tensor, n_rows: int, ids: torch.Tensor, out_u8: torch.Tensor) -> None:
        from .kernels.bitpack import gather_rows

        gather_rows(base, offsets, lengths, flags, n_rows, ids, out_u8, self.kernel_tables(out_u8.device))

    # -- tables and files -------------------------------------------------------------------------
    def same_tables(self, other: "Codec") -> bool:
        return (isinstance(other, IBPCodec) and self.geometry == other.geometry
                and np.array_equal(self.mask, other.mask) and np.array_equal(self.bitval, other.bitval))

    def header(self) -> dict:
        return {
            "method": self.method,
            "dtype": dtype_to_name(self.dtype),
            "row_shape": list(self.row_shape),
            "row_bytes": self.row_bytes,
            "chunk_bytes": self.chunk_bytes,
            "threshold": self.threshold,
            "fitted_rows": self.fitted_rows,
        }

    def sections(self) -> list[np.ndarray]:
        return [self.mask, self.bitval]

    @classmethod
    def _from_sections(cls, hdr: dict, sections: list[np.ndarray]) -> "IBPCodec":
        try:
            return IBPCodec(np.asarray(sections[0]).astype(np.uint64), np.asarray(sections[1]).astype(np.uint64),
                            chunk_bytes=int(hdr["chunk_bytes"]), row_bytes=int(hdr["row_bytes"]),
                            dtype=name_to_dtype(hdr["dtype"]), row_shape=tuple(hdr["row_shape"]),
                            threshold=float(hdr["threshold"]), fitted_rows=int(hdr.get("fitted_rows", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"bad codec header: {exc}") from None


class RawCodec(IBPCodec):
    """Rows stored verbatim: every stored length is ``row_bytes``, no row is flagged coded, no tables.

    It is IBP with an empty mask (the bytes IBP stores for a row that does not shrink), so every IBP kernel,
    store and the KV append store serve it unchanged; the host paths skip the size computation.
    """

    method = "raw"
    section_names = ()

    def __init__(self, dtype: torch.dtype, row_shape: tuple[int, ...], *, fitted_rows: int = 0) -> None:
        row_shape = tuple(int(s) for s in row_shape)
        row_bytes = _row_bytes_of(dtype, row_shape)
        if row_bytes < 1:
            raise RowShapeError(f"rows of zero bytes cannot be stored (row shape {row_shape})")
        chunk = next(c for c in (8, 4, 2, 1) if row_bytes % c == 0)
        zeros = np.zeros(row_bytes // chunk, dtype=np.uint64)
        super().__init__(zeros, zeros.copy(), chunk_bytes=chunk, row_bytes=row_bytes, dtype=dtype, row_shape=row_shape,
                         threshold=1.0, fitted_rows=fitted_rows)

    @property
    def metadata_nbytes(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"RawCodec(dtype={dtype_to_name(self.dtype)}, row_shape={self.row_shape}, row_bytes={self.row_bytes})"

    def row_lengths(self, rows_u8: np.ndarray) -> np.ndarray:
        return np.full(self._check_u8_rows(rows_u8).shape[0], self.row_bytes, dtype=np.int32)

    def size_rows_gpu(self, rows_u8: torch.Tensor) -> torch.Tensor:
        if rows_u8.dim() != 2 or rows_u8.shape[1] != self.row_bytes:
            raise RowShapeError(f"rows_u8: expected [M, {self.row_bytes}] bytes, got {tuple(rows_u8.shape)}")
        return torch.full((rows_u8.shape[0],), self.row_bytes, dtype=torch.int32, device=rows_u8.device)

    def header(self) -> dict:
        return {"method": self.method, "dtype": dtype_to_name(self.dtype), "row_shape": list(self.row_shape),
                "row_bytes": self.row_bytes, "fitted_rows": self.fitted_rows}

    def sections(self) -> list[np.ndarray]:
        return []

    @classmethod
    def _from_sections(cls, hdr: dict, sections: list[np.ndarray]) -> "RawCodec":
        try:
            codec = RawCodec(name_to_dtype(hdr["dtype"]), tuple(hdr["row_shape"]),
                             fitted_rows=int(hdr.get("fitted_rows", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"bad raw codec header: {exc}") from None
        if int(hdr.get("row_bytes", codec.row_bytes)) != codec.row_bytes:
            raise FormatError(f"bad raw codec header: row_bytes {hdr['row_bytes']} is not {codec.row_shape} of "
                              f"{codec.dtype} ({codec.row_bytes} bytes)")
        return codec


def check_codec(codec: object, what: str = "codec") -> Codec:
    """``codec`` if it is a :class:`Codec` (any method), else CodecKindError naming what was given."""
    if not isinstance(codec, Codec):
        raise CodecKindError(f"{what}: expected an ibpcache Codec (IBPCodec, ExponentCodec or RawCodec), got "
                             f"{type(codec).__name__}")
    return codec
