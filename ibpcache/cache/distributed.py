"""Rows partitioned over torch.distributed ranks: each rank stores a slice, ``fetch`` returns any rows, exactly.

A :class:`PartitionBook` says which rank owns each global row and at which local position (DistDGL's
partition book; TorchRec's row-wise sharding plan is the same map). :class:`DistributedRows` holds this rank's
rows (a ``CompressedRows``, attached from a node's shared store or private, or a raw tensor) and answers
``fetch(ids)`` with three ``all_to_all_single`` exchanges over the process group: request counts, requested
local ids, then the rows themselves -- sent in their stored (compressed) form, so the wire carries
``lengths.sum()`` bytes, not ``n * row_bytes``; the requester decodes with the owner's codec (any method: IBP,
exponent coding, raw), which all ranks exchange once at construction as ``header()`` + ``sections()`` (what files
and shared stores keep) and rebuild with ``Codec.from_header``. Every rank must call ``fetch`` together (a collective), with its own ids
(an empty tensor is fine). Works over gloo (CPU, CI) and, for CPU tensors, any backend with all_to_all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .._validation import check_ids
from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import InvalidArgumentError, InvalidTypeError, RowDtypeError, RowShapeError

__all__ = ["PartitionBook", "DistributedRows"]


@dataclass(frozen=True)
class PartitionBook:
    """Global row id -> (owner rank, local id). ``owner``: int32 [N]; ``local``: int64 [N]."""

    owner: torch.Tensor
    local: torch.Tensor
    world_size: int

    @classmethod
    def from_owner(cls, owner: torch.Tensor, world_size: int) -> "PartitionBook":
        """Book from an owner rank per row (e.g. a METIS/DistDGL assignment); local ids follow global order."""
        owner = torch.as_tensor(owner).to(torch.int64).reshape(-1)
        if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= world_size):
            raise InvalidArgumentError(f"owner ranks must lie in [0, {world_size}), got [{int(owner.min())}, "
                                       f"{int(owner.max())}]")
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=world_size)
        starts = torch.cumsum(counts, 0) - counts
        local = torch.empty_like(owner)
        local[order] = torch.arange(owner.numel()) - torch.repeat_interleave(starts, counts)
        return cls(owner.to(torch.int32), local, int(world_size))

    @classmethod
    def contiguous(cls, n_rows: int, world_size: int) -> "PartitionBook":
        """Row ranges: rank r owns ``[r*ceil(N/W), (r+1)*ceil(N/W))`` (TorchRec row-wise sharding)."""
        if world_size < 1 or n_rows < 0:
            raise InvalidArgumentError(f"need world_size >= 1 and n_rows >= 0, got {world_size}, {n_rows}")
        per = -(-n_rows // world_size) if n_rows else 1
        return cls.from_owner(torch.arange(n_rows) // per, world_size)

    @property
    def n_rows(self) -> int:
        return int(self.owner.numel())

    def rows_of(self, rank: int) -> torch.Tensor:
        """Global ids owned by ``rank``, in local-id order (what that rank must store)."""
        return torch.nonzero(self.owner == rank).reshape(-1)


class DistributedRows:
    """This rank's partition of a row table plus a collective ``fetch`` of arbitrary global rows."""

    def __init__(self, local_rows: "CompressedRows | torch.Tensor", book: PartitionBook,
                 group: "dist.ProcessGroup | None" = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if book.world_size != self.world_size:
            raise InvalidArgumentError(f"partition book is for {book.world_size} ranks, the group has "
                                       f"{self.world_size}")
        self.book = book
        n_local = int((book.owner == self.rank).sum())
        if isinstance(local_rows, CompressedRows):
            self.packed: CompressedRows | None = local_rows
            self.raw: torch.Tensor | None = None
            self.row_shape, self.dtype = tuple(local_rows.codec.row_shape), local_rows.dtype
            have = local_rows.n_rows
        elif isinstance(local_rows, torch.Tensor):
            self.packed, self.raw = None, local_rows.contiguous().cpu()
            self.row_shape, self.dtype = tuple(local_rows.shape[1:]), local_rows.dtype
            have = int(local_rows.shape[0])
        else:
            raise InvalidTypeError(f"local_rows: expected CompressedRows or a tensor, got {type(local_rows).__name__}")
        if have != n_local:
            raise InvalidArgumentError(f"rank {self.rank} holds {have} rows but the partition book gives it {n_local}")
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()
        self.codecs = self._exchange_codecs()
        self.bytes_sent = 0
        self.bytes_received = 0

    def _exchange_codecs(self) -> "list[Codec | None]":
        """Every rank's codec (None for a raw partition), so rows can travel in their stored form; each travels as
        its ``header()`` and ``sections()`` and is rebuilt with ``Codec.from_header`` (any method). Also checks that
        every rank holds rows of one dtype and shape (else RowDtypeError / RowShapeError on every rank)."""
        mine = None
        if self.packed is not None:
            c = self.packed.codec
            mine = (c.header(), [np.ascontiguousarray(a) for a in c.sections()])
        desc = (self.row_shape, str(self.dtype), mine)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, desc, group=self.group)
        codecs: list[Codec | None] = []
        for r, (shape, dtype, codec) in enumerate(everyone):
            if dtype != str(self.dtype):
                raise RowDtypeError(f"rank {r} holds {dtype} rows, rank {self.rank} {self.dtype} rows")
            if tuple(shape) != self.row_shape:
                raise RowShapeError(f"rank {r} holds rows of shape {tuple(shape)}, rank {self.rank} rows of shape "
                                    f"{self.row_shape}")
            codecs.append(None if codec is None else Codec.from_header(codec[0], *codec[1]))
        return codecs

    # -- the collective fetch ---------------------------------------------------------------------

    def _a2a(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
             spare: int = 0) -> torch.Tensor:
        """One uneven all-to-all; ``spare`` zero bytes follow the result (the decoders' aligned reads)."""
        n = sum(recv_splits)
        recv = torch.zeros(n + spare, dtype=send.dtype)
        dist.all_to_all_single(recv[:n], send, recv_splits, send_splits, group=self.group)
        return recv

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``table[ids]`` (global ids, any order, duplicates fine), bit-exact, on the CPU. Collective."""
        ids = check_ids(ids, self.book.n_rows, torch.device("cpu"))
        owner = self.book.owner[ids].to(torch.int64)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        wanted = self._a2a(self.book.local[ids[order]], sc, rc)  # local ids others want from me
        lengths, payload = self._serve(wanted)
        got_lengths = self._a2a(lengths, rc, sc)  # stored length of each row I asked for
        byte_send = _split_sums(lengths, rc)
        byte_recv = _split_sums(got_lengths, sc)
        data = self._a2a(payload, byte_send, byte_recv, spare=16)
        self.bytes_sent += int(payload.numel())
        self.bytes_received += sum(byte_recv)
        out = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        out_u8 = out.view(torch.uint8).reshape(ids.numel(), self.row_bytes)
        self._decode(data, got_lengths, sc, order, out_u8)
        return out

    def _serve(self, local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 stored length per requested row, their stored bytes back to back)."""
        if self.packed is None:
            assert self.raw is not None
            rows = self.raw.view(torch.uint8).reshape(-1, self.row_bytes)[local_ids]
            return torch.full((local_ids.numel(),), self.row_bytes, dtype=torch.int32), rows.reshape(-1)
        self.packed.check_shared()
        lengths = self.packed.lengths[local_ids]
        starts = self.packed.offsets[local_ids]
        total = int(lengths.sum(dtype=torch.int64))
        excl = torch.cumsum(lengths.to(torch.int64), 0) - lengths
        src = torch.repeat_interleave(starts - excl, lengths.to(torch.int64), output_size=total) + torch.arange(total)
        return lengths.clone(), self.packed.data[src]

    def _decode(self, data: torch.Tensor, lengths: torch.Tensor, counts: list[int], order: torch.Tensor,
                out_u8: torch.Tensor) -> None:
        """Decode the rows each owner sent (its codec) into their request positions."""
        offsets = torch.cumsum(lengths.to(torch.int64), 0) - lengths
        data_np, out_np = data.numpy(), out_u8.numpy()
        start = 0
        for r, n in enumerate(counts):
            if n == 0:
                continue
            sl = slice(start, start + n)
            dest = order[sl].numpy()
            codec = self.codecs[r]
            if codec is None:
                rows = data[int(offsets[start]) : int(offsets[start]) + n * self.row_bytes]
                out_np[dest] = rows.numpy().reshape(n, self.row_bytes)
            else:
                lens = lengths[sl].numpy()
                codec.decode_rows_at(data_np, offsets[sl].numpy(), lens, out_np, dest.astype(np.int64),
                                     compressed=(lens < self.row_bytes).astype(np.uint8))
            start += n


def _split_sums(values: torch.Tensor, splits: list[int]) -> list[int]:
    """Sum of ``values`` over each consecutive split (bytes per peer)."""
    return [int(p.sum(dtype=torch.int64)) for p in torch.split(values, splits)]

