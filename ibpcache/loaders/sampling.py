"""Uniform neighbour sampling in plain torch: the same samples on the CPU and on the GPU, many batches per call.

Why plain torch: PyPI's DGL has no CUDA and PyG's ``NeighborSampler`` needs pyg-lib or torch-sparse, yet a graph
of a few hundred million edges fits in GPU memory, where sampling costs a fraction of a CPU sampler's time.
:class:`NeighborSampler` keeps the graph as CSC (in-neighbours grouped by destination) on its device and draws, per
hop, up to ``k`` distinct in-neighbours of each node, uniformly (Floyd's algorithm; all of them when a node has
fewer).

Why the samples are the same on every device: the random numbers are not drawn from a generator but computed, as
a 32-bit integer hash of (batch key, hop, node id, draw index). Integer arithmetic, stable sorts, ``unique`` and
``searchsorted`` give the same result on the CPU and on CUDA, so a batch's sample depends only on its key and its
seed nodes: not on the device, on which thread or worker sampled it, on the batches sampled before it, or on how
many batches were sampled in one call. That is what lets a loader sample ahead in a thread (or on a side stream)
and still give the batches of an unpipelined run bit for bit. (``rand_below`` maps a 32-bit hash to ``[0, n)`` by
multiply-shift; its bias is below ``n / 2**32``, under 1e-4 for a node of 400k neighbours.)

Why several batches per call: on the GPU a hop is a few dozen small kernels whatever the batch size, so the host's
launch work, not the GPU, bounds a per-batch sampler. :meth:`NeighborSampler.sample` takes a list of seed batches
and samples them together (node ids are made unique per batch by keying them ``batch * num_nodes + node``); each
batch comes out exactly as if it had been sampled alone.

Why so few host reads: a call reads the GPU back twice per hop (the hop's edge count, which sizes its output, and
``unique``'s size) and once at the end (every batch's sizes and the seed checks), no more. Each read waits for the
sampler's queued kernels, and when the sampler runs ahead of training on the same GPU (a pipelined loader) those
kernels share the GPU with the training step's, so every read is a stall of the sampler thread; ``bincount``,
``nonzero``, a mask index and a tensor built from a Python list would each add one. Sizes known on the host are
kept there, counts of sorted ids come from ``searchsorted``, host integers go over through pinned memory.

Two layouts of the result, one algorithm:

* ``frontier=False`` (DGL's message-flow blocks): hop ``h`` samples every node known so far, so hop ``h``'s
  destination nodes are the first ``n_dst`` nodes and a block per hop is ``(src, dst, n_src, n_dst)``.
* ``frontier=True`` (PyG's ``NeighborSampler``): hop ``h`` samples only the nodes the previous hop added.

In both, ``Sample.nodes`` lists the seeds first, then each hop's new nodes in ascending id order, and every
position in ``Hop.src`` / ``Hop.dst`` indexes ``Sample.nodes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.sampling_hop import KMAX as SAMPLING_KMAX
from ..cache.sampling_hop import hop_positions
from ..errors import InvalidArgumentError, InvalidIdsError, InvalidTypeError

__all__ = ["NeighborSampler", "Sample", "Hop", "batch_key", "seeds_key", "mix32", "graph_bytes",
           "choose_sampler_device"]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive integers over the 32-bit range
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3's 32-bit finalizer constants (public domain)
_MAX_NODES = 1 << 31  # node ids must fit the 32-bit hash input
_SEED_KEY = 0x5EED


def _mul32(x: Any, c: int) -> Any:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)``, in 16-bit halves so no int64 product overflows (a signed
    overflow in torch's C++ kernels is undefined behaviour, not a wrap we may rely on). Works on ints and tensors."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: Any) -> Any:
    """MurmurHash3's 32-bit finalizer: a bijection of ``[0, 2**32)`` whose every output bit depends on every input
    bit. ``x`` is a Python int or an int64 tensor of values in ``[0, 2**32)``; the same arithmetic on both."""
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX2)
    return x ^ (x >> 16)


def batch_key(*parts: int) -> int:
    """A 32-bit key from integers (seed, epoch, batch index, ...): what a batch's sample is drawn from."""
    h = _SEED_KEY
    for p in parts:
        p = int(p)
        for word in (p & _M32, (p >> 32) & _M32):
            h = mix32((h + _GOLDEN + mix32(word)) & _M32)
    return int(h)


def seeds_key(seeds: torch.Tensor) -> int:
    """A 32-bit key of a batch's seed nodes in order (hashed where they are; one host read): for loaders that hand a
    sampler seed nodes but no batch index (PyG's)."""
    ids = seeds.reshape(-1).to(torch.int64)
    pos = torch.arange(ids.numel(), device=ids.device)
    h = mix32((mix32(ids & _M32) + ((pos * _GOLDEN) & _M32)) & _M32)
    return batch_key(int(h.sum()), ids.numel())


def _rand_below(h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Map 32-bit hashes ``h`` to ``[0, n)`` (multiply-shift; ``n < 2**31`` so the product stays below 2**63)."""
    return (h * n) >> 32


def graph_bytes(num_nodes: int, num_edges: int, edge_ids: bool = True) -> int:
    """Device memory a :class:`NeighborSampler` keeps for a graph: CSC pointers, neighbours (and edge ids), int64."""
    return 8 * (int(num_nodes) + 1) + 8 * int(num_edges) * (2 if edge_ids else 1)


def choose_sampler_device(num_nodes: int, num_edges: int, device: "str | torch.device" = "auto", *,
                          edge_ids: bool = False, max_fraction: float = 0.25) -> torch.device:
    """Where to sample: ``device`` when given (``"cpu"`` / ``"cuda"``); for ``"auto"`` the GPU when the sampler's
    graph (:func:`graph_bytes`) takes at most ``max_fraction`` of the GPU's free memory, else the CPU.

    Why a fraction, not "whatever fits": the GPU also holds the feature cache, the model and the batches in flight;
    a sampler that crowds them out costs more than it saves.
    """
    if str(device) != "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            from ..errors import DeviceError

            raise DeviceError("sampler device 'cuda' was requested but torch sees no GPU (use 'auto' or 'cpu')")
        return dev
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info()
    fits = graph_bytes(num_nodes, num_edges, edge_ids) <= max_fraction * free
    return torch.device("cuda", torch.cuda.current_device()) if fits else torch.device("cpu")


@dataclass
class Hop:
    """The edges one hop sampled, as positions in :attr:`Sample.nodes` (neighbour ``src`` -> sampled node ``dst``).

    Edges are ordered by ``dst`` position, then by CSC position. Nodes at positions ``< n_dst`` were known before
    the hop (with ``frontier=False`` each of them was sampled), ``< n_src`` after it.

    With ``NeighborSampler(..., groups=True)`` a hop also carries its edges' offsets per destination (CSC: ``src``
    is already in that order) and the edges grouped by source (CSR, in edge order within a source), which a
    segment-sum aggregation reads forward and backward.
    """

    src: torch.Tensor  # int64 [E]
    dst: torch.Tensor  # int64 [E]
    n_src: int
    n_dst: int
    eid: "torch.Tensor | None" = None  # int64 [E], ids in the input edge order (when the sampler keeps them)
    dst_ptr: "torch.Tensor | None" = None  # int64 [n_dst + 1]: destination d's edges are [dst_ptr[d], dst_ptr[d+1])
    dst_by_src: "torch.Tensor | None" = None  # int64 [E]: each edge's ``dst``, edges grouped by ``src`` (stable)
    src_ptr: "torch.Tensor | None" = None  # int64 [n_src + 1]: source s's edges in ``dst_by_src``

    def dst_degree(self) -> torch.Tensor:
        """int64 [n_dst]: the hop's edges per destination position (``bincount(dst, minlength=n_dst)``), from a
        ``searchsorted`` on ``dst``, which is ascending: ``bincount`` on a GPU reads the largest id back to the host,
        a stall for a sampler that runs ahead of training."""
        return _per_batch(self.dst, self.n_dst)

    def record_stream(self, stream: Any) -> None:
        for t in (self.src, self.dst, self.eid, self.dst_ptr, self.dst_by_src, self.src_ptr):
            if t is not None and t.is_cuda:
                t.record_stream(stream)


@dataclass
class Sample:
    """One batch's sample: ``nodes`` (seeds first, then each hop's new nodes in ascending id order) and its hops."""

    nodes: torch.Tensor  # int64 [n]
    hops: list[Hop] = field(default_factory=list)

    @property
    def num_seeds(self) -> int:
        return self.hops[0].n_dst if self.hops else int(self.nodes.numel())

    def record_stream(self, stream: Any) -> None:
        if self.nodes.is_cuda:
            self.nodes.record_stream(stream)
        for hop in self.hops:
            hop.record_stream(stream)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _host_ints(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of host integers on ``device``. To a GPU through pinned memory without blocking: a copy from
    pageable memory (``torch.tensor(values, device=...)``) waits for the stream, which in a sampler thread means
    for its queued kernels, on a GPU that is busy training."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _per_batch(sorted_bid: torch.Tensor, n_batch: int) -> torch.Tensor:
    """How many entries of ``sorted_bid`` (ascending batch ids in ``[0, n_batch)``) each batch has: ``bincount``'s
    counts from a ``searchsorted``, because ``bincount`` on a GPU reads the largest id back to the host."""
    edges = torch.searchsorted(sorted_bid, torch.arange(n_batch + 1, device=sorted_bid.device))
    return edges[1:] - edges[:-1]


def _run_offsets(sorted_key: torch.Tensor, count: torch.Tensor, total: int, e_first: torch.Tensor) -> torch.Tensor:
    """Per batch, the ``count[b] + 1`` offsets (from the batch's first edge) of each of its nodes' runs in
    ``sorted_key`` (ascending positions in a node list of ``total`` nodes, batch after batch; batch ``b``'s edges
    start at ``e_first[b]``), laid end to end: [total + batches]. A batch's last offset is where the next batch's
    first node starts, i.e. its edge count."""
    dev = sorted_key.device
    n_batch = count.numel()
    ext_bid = torch.repeat_interleave(torch.arange(n_batch, device=dev), count + 1, output_size=total + n_batch)
    node = torch.arange(total + n_batch, device=dev) - ext_bid
    return torch.searchsorted(sorted_key, node) - e_first[ext_bid]


def _ranges(start: torch.Tensor, length: torch.Tensor, total: int) -> torch.Tensor:
    """``cat([arange(s, s + l) for s, l in zip(start, length)])`` with ``total`` = the lengths' sum known on the
    host: the indices of a mask that selects one run per batch, without ``nonzero``'s host read."""
    run = torch.repeat_interleave(torch.arange(start.numel(), device=start.device), length, output_size=total)
    return start[run] + torch.arange(total, device=start.device) - _exclusive_cumsum(length)[run]


class NeighborSampler:
    """Up to ``fanouts[h]`` distinct uniform in-neighbours per node at hop ``h`` (``-1``: all), in torch ops on
    ``device``; identical samples on every device (module docstring).

    Args:
        src, dst: int64 [E] edges ``src -> dst`` (a node's in-neighbours are the ``src`` of its in-edges).
        num_nodes: node count (ids in ``[0, num_nodes)``, fewer than 2**31).
        fanouts: in hop order, from the seeds outwards (PyG's ``num_neighbors``; DGL's
            ``NeighborSampler([f_input, ..., f_output])`` lists them the other way round).
        device: where the graph lives and sampling runs.
        frontier: ``True`` samples only the nodes the previous hop added (PyG), ``False`` every node known (DGL
            blocks).
        edge_ids: keep the CSC -> input edge permutation and report ``Hop.eid`` (8 bytes per edge more).
        groups: also group each hop's edges by destination and by source (``Hop.dst_ptr``, ``Hop.dst_by_src``,
            ``Hop.src_ptr``): one sort per hop for all the call's batches, instead of one per batch and hop in the
            caller.
        hop_kernel: on a CUDA device, draw each hop's neighbours (fanout -1..64) in one kernel
            (``ibpcache.cache.sampling_hop``) instead of about 100 torch ops: the same samples, with a fifth to a
            half less sampler host time (measured on an H100). ``False`` keeps the torch ops (the reference).
            Ignored on the CPU.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, num_nodes: int, fanouts: Sequence[int], *,
                 device: "str | torch.device" = "cpu", frontier: bool = False, edge_ids: bool = True,
                 groups: bool = False, hop_kernel: bool = True) -> None:
        for name, t in (("src", src), ("dst", dst)):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"NeighborSampler: {name}: expected an integer torch.Tensor, got "
                                       f"{type(t).__name__}")
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise InvalidIdsError(f"NeighborSampler: {name} must hold integer node ids, got dtype {t.dtype}")
        if src.dim() != 1 or src.shape != dst.shape:
            raise InvalidArgumentError(f"NeighborSampler: src and dst must be 1-D of one length, got shapes "
                                       f"{tuple(src.shape)} and {tuple(dst.shape)}")
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or not 0 < num_nodes < _MAX_NODES:
            raise InvalidArgumentError(f"NeighborSampler: num_nodes must be an int in [1, 2**31), got {num_nodes!r}")
        if (not isinstance(fanouts, Sequence) or isinstance(fanouts, str)
                or not all(isinstance(k, int) and not isinstance(k, bool) and k >= -1 for k in fanouts)):
            raise InvalidArgumentError(f"NeighborSampler: fanouts: expected a list of ints >= -1 (-1: all), got "
                                       f"{fanouts!r}")
        self.device = torch.device(device)
        src = src.to(self.device, torch.int64)
        dst = dst.to(self.device, torch.int64)
        if src.numel():
            lo = torch.minimum(src.min(), dst.min())
            hi = torch.maximum(src.max(), dst.max())
            if int(lo) < 0 or int(hi) >= num_nodes:
                raise InvalidIdsError(f"NeighborSampler: edges hold node ids outside [0, {num_nodes})")
        order = torch.argsort(dst, stable=True)  # stable: the same CSC on every device
        self.row = src[order]
        self.eid: torch.Tensor | None = order if edge_ids else None
        self.colptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=self.device)
        self.colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
        del order
        self.num_nodes = num_nodes
        self.fanouts = [int(k) for k in fanouts]
        self.frontier = bool(frontier)
        self.groups = bool(groups)
        self.hop_kernel = bool(hop_kernel) and self.device.type == "cuda"

    @property
    def in_degree(self) -> torch.Tensor:
        """int64 [num_nodes] on the sampler's device."""
        return self.colptr[1:] - self.colptr[:-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.row, self.colptr, self.eid) if t is not None)

    # ------------------------------------------------------------------------------------------------------------

    def sample(self, seeds: "torch.Tensor | Sequence[torch.Tensor]", keys: "int | Sequence[int]"
               ) -> "Sample | list[Sample]":
        """Sample one batch (``seeds`` a tensor, ``keys`` an int) or several at once (lists of both, one key per
        batch); a batch's sample depends only on its seeds and key. Seeds: distinct int64 node ids (any device)."""
        single = isinstance(seeds, torch.Tensor)
        batches = [seeds] if single else list(seeds)
        key_list = [keys] if single else list(keys)
        if len(key_list) != len(batches):
            raise InvalidArgumentError(f"NeighborSampler.sample: {len(batches)} seed batches but {len(key_list)} keys")
        out = self._sample_many(batches, [int(k) & _M32 for k in key_list])
        return out[0] if single else out

    def _check_seeds(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        checked = []
        for s in batches:
            if not isinstance(s, torch.Tensor) or s.dtype == torch.bool or s.is_floating_point() or s.is_complex():
                raise InvalidIdsError(f"NeighborSampler: seeds must be integer tensors, got "
                                      f"{getattr(s, 'dtype', type(s).__name__)}")
            checked.append(s.reshape(-1).to(self.device, torch.int64))
        return checked

    def _sample_many(self, batches: list[torch.Tensor], keys: list[int]) -> list[Sample]:
        dev = self.device
        batches = self._check_seeds(batches)
        n_batch = len(batches)
        if n_batch == 0:
            return []
        counts = [int(s.numel()) for s in batches]
        seeds = torch.cat(batches)
        count = _host_ints(counts, dev)  # nodes known per batch
        hop_keys = _host_ints([[batch_key(key, h) for key in keys] for h in range(len(self.fanouts))], dev)
        total = sum(counts)
        bid = torch.repeat_interleave(torch.arange(n_batch, device=dev), count, output_size=total)
        flags = self._seed_flags(seeds, bid)
        # Out-of-range seeds are clamped so no gather reads past the graph; flags raises before any result is
        # returned (read with the sizes at the end: one host read, not one more per call).
        nodes = seeds.clamp(0, self.num_nodes - 1)
        lo = torch.zeros(n_batch, dtype=torch.int64, device=dev)  # first position of each batch's frontier
        lo_total = 0
        per_hop: list[tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "tuple[torch.Tensor, ...] | None",
                            torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for h, k in enumerate(self.fanouts):
            ptr = _exclusive_cumsum(count)
            pos = torch.arange(total, device=dev) - ptr[bid]  # each node's position in its batch
            if self.frontier:
                sampled = _ranges(ptr + lo, count - lo, total - lo_total)
                s_nodes, s_bid, s_pos = nodes[sampled], bid[sampled], pos[sampled]
            else:
                s_nodes, s_bid, s_pos = nodes, bid, pos
            nbr, seg, eid = self._hop(s_nodes, hop_keys[h][s_bid], k)
            e_bid = s_bid[seg]
            dst_pos = s_pos[seg]
            src_pos, new_nodes, new_bid, n_new = self._relabel(nodes, bid, ptr, count, nbr, e_bid, n_batch)
            new_count = count + n_new
            new_ptr = _exclusive_cumsum(new_count)
            grown = torch.empty(total + int(new_nodes.numel()), dtype=torch.int64, device=dev)
            grown[new_ptr[bid] + pos] = nodes
            new_rank = torch.arange(new_nodes.numel(), device=dev) - _exclusive_cumsum(n_new)[new_bid]
            grown[new_ptr[new_bid] + count[new_bid] + new_rank] = new_nodes
            n_edges = _per_batch(e_bid, n_batch)
            groups = (self._groups(src_pos, dst_pos, e_bid, n_edges, (ptr, count, total),
                                   (new_ptr, new_count, int(grown.numel()))) if self.groups else None)
            per_hop.append((src_pos, dst_pos, eid, groups, n_edges, count, new_count))
            lo, lo_total = count, total
            nodes, count, total = grown, new_count, int(grown.numel())
            bid = torch.repeat_interleave(torch.arange(n_batch, device=dev), count, output_size=total)
        return self._split(nodes, count, per_hop, n_batch, flags)

    @staticmethod
    def _groups(src_pos: torch.Tensor, dst_pos: torch.Tensor, e_bid: torch.Tensor, n_edges: torch.Tensor,
                before: tuple[torch.Tensor, torch.Tensor, int], after: tuple[torch.Tensor, torch.Tensor, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A hop's edges grouped by destination and by source, for all the call's batches at once: (every batch's
        ``dst_ptr`` end to end, ``dst_by_src``, every batch's ``src_ptr`` end to end). ``before`` / ``after``: the
        (first position, node count) per batch and total node count of the node lists before and after the hop.
        Keys are positions in the call's node list, so one stable sort groups every batch by source; the edges
        are already grouped by destination."""
        e_first = _exclusive_cumsum(n_edges)
        dst_key = before[0][e_bid] + dst_pos  # ascending: edges come ordered by batch, then destination
        src_key, order = torch.sort(after[0][e_bid] + src_pos, stable=True)
        return (_run_offsets(dst_key, before[1], before[2], e_first), dst_pos[order],
                _run_offsets(src_key, after[1], after[2], e_first))

    def _seed_flags(self, nodes: torch.Tensor, bid: torch.Tensor) -> torch.Tensor:
        """int64 [2] on the device: (some seed is outside the graph, some batch repeats a seed); read by
        :meth:`_split` with the sizes."""
        if nodes.numel() == 0:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        keyed = torch.sort(bid * self.num_nodes + nodes).values
        return torch.stack([(nodes < 0).any() | (nodes >= self.num_nodes).any(),
                            (keyed[1:] == keyed[:-1]).any()]).to(torch.int64)

    def _raise_bad_seeds(self, flags: list[int]) -> None:
        if flags[0]:
            raise InvalidIdsError(f"NeighborSampler: seed ids outside [0, {self.num_nodes})")
        if flags[1]:
            raise InvalidArgumentError("NeighborSampler: the seed nodes of one batch must be distinct")

    def _hop(self, nodes: torch.Tensor, node_batch_keys: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]:
        """(neighbour id, index into ``nodes``, edge id) of up to ``k`` distinct in-edges per node, ordered by node
        then CSC position. One host read (the edge count, which sizes the output).

        Floyd's draws are computed for every node and kept where the node has more than ``k`` in-neighbours (the
        others take all of theirs): selecting those nodes first would be one more host read, and a node's draws
        depend only on its degree and key, so the kept ones are the same either way."""
        dev = self.device
        start = self.colptr[nodes]
        deg = self.colptr[nodes + 1] - start
        counts = deg if k < 0 else deg.clamp(max=k)
        total = int(counts.sum())
        if self.hop_kernel and k <= SAMPLING_KMAX:
            pos, seg = hop_positions(self.colptr, nodes, node_batch_keys, _exclusive_cumsum(counts), k, total)
            return self.row[pos], seg, (self.eid[pos] if self.eid is not None else None)
        seg = torch.repeat_interleave(torch.arange(nodes.numel(), device=dev), counts, output_size=total)
        first = _exclusive_cumsum(counts)
        offset = torch.arange(total, device=dev) - first[seg]
        if k > 0 and total:
            node_keys = mix32((mix32(nodes) + node_batch_keys) & _M32)
            chosen = self._floyd(deg, node_keys, k)
            # a node with deg > k has exactly k edges, offsets 0..k-1: its j-th edge takes its j-th draw
            offset = torch.where((deg > k)[seg], chosen.reshape(-1)[seg * k + offset], offset)
        pos = start[seg] + offset
        return self.row[pos], seg, (self.eid[pos] if self.eid is not None else None)

    def _floyd(self, deg: torch.Tensor, node_keys: torch.Tensor, k: int) -> torch.Tensor:
        """A uniform k-subset of ``[0, deg)`` per row with ``deg > k`` (Floyd: for ``hi = deg-k .. deg-1`` take
        ``t ~ U[0, hi]``, or ``hi`` when ``t`` is taken already), sorted ascending; rows with ``deg <= k`` get values
        the caller ignores. All k draws are hashed at once.

        The sequential "taken already?" test is resolved in ``ceil(log2 k)`` rounds of whole-tensor ops instead of
        k - 1 dependent steps (the sampler's host cost: each step was a few kernel launches, per hop and batch).
        Draw j is taken (step j keeps ``hi_j``) iff an earlier draw equals it, or it equals the ``hi_i`` an earlier
        step i kept, i.e. iff ``dup_j or (t_j == hi_i for i < j and taken_i)``: a chain through at most one earlier
        step, which pointer jumping follows. The subsets are exactly those of the step-by-step loop."""
        dev = self.device
        steps = torch.arange(k, device=dev)
        salt = (steps * _GOLDEN) & _M32
        draws = mix32((node_keys.unsqueeze(1) + salt) & _M32)
        low = (deg - k).unsqueeze(1)
        hi = low + steps  # [n, k]
        t = _rand_below(draws, hi + 1)
        earlier = torch.ones(k, k, dtype=torch.bool, device=dev).tril(-1)  # [j, i]: i < j
        taken = ((t.unsqueeze(2) == t.unsqueeze(1)) & earlier).any(2)  # an earlier draw equals t_j
        ptr = t - low  # t_j == hi_i for i = ptr_j, if 0 <= ptr_j < j
        follow = (ptr >= 0) & (ptr < steps)
        ptr = torch.where(follow, ptr, 0)
        for _ in range(max(k - 1, 0).bit_length()):  # taken_j |= follow_j & taken_ptr_j, the chain halved each round
            taken = taken | (follow & taken.gather(1, ptr))
            follow = follow & follow.gather(1, ptr)
            ptr = ptr.gather(1, ptr)
        return torch.where(taken, hi, t).sort(dim=1).values

    def _relabel(self, nodes: torch.Tensor, bid: torch.Tensor, ptr: torch.Tensor, count: torch.Tensor,
                 nbr: torch.Tensor, e_bid: torch.Tensor, n_batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions of the neighbours in their batch's node list once it has grown by the new ones.

        Returns (position of each neighbour, new node ids, their batch, new nodes per batch); a batch's new nodes
        are its neighbours not yet in its list, ascending. Keys ``batch * num_nodes + node`` keep batches apart.
        One host read (``unique``'s size): known neighbours are replaced by a key above every real one, which is
        appended once so it is always the last unique key and is dropped by size, not by a mask.
        """
        dev, n = self.device, self.num_nodes
        keyed = e_bid * n + nbr
        if nodes.numel():
            known_sorted, known_order = torch.sort(bid * n + nodes)
            at = torch.searchsorted(known_sorted, keyed).clamp_(max=nodes.numel() - 1)
            known = known_sorted[at] == keyed
        else:
            known_order = at = torch.zeros_like(keyed)
            known = torch.zeros_like(keyed, dtype=torch.bool)
        above = torch.full((1,), n_batch * n, dtype=torch.int64, device=dev)
        new_keys = torch.unique(torch.cat([torch.where(known, above, keyed), above]))[:-1]  # batch-major, ascending
        new_bid = torch.div(new_keys, n, rounding_mode="floor")
        new_nodes = new_keys - new_bid * n
        n_new = _per_batch(new_bid, n_batch)
        rank = torch.searchsorted(new_keys, keyed)
        src_pos = torch.where(known, known_order[at] - ptr[e_bid],
                              count[e_bid] + rank - _exclusive_cumsum(n_new)[e_bid])
        return src_pos, new_nodes, new_bid, n_new

    def _split(self, nodes: torch.Tensor, count: torch.Tensor, per_hop: list, n_batch: int,
               flags: torch.Tensor) -> list[Sample]:
        """Per-batch views of the chunk's tensors (one host read of every size and of the seed flags)."""
        sizes = torch.cat([flags, torch.stack([count] + [t for hop in per_hop for t in hop[4:]]).reshape(-1)]).tolist()
        self._raise_bad_seeds(sizes[:2])
        node_count = sizes[2:2 + n_batch]
        hop_sizes = [sizes[2 + n_batch * (i + 1):2 + n_batch * (i + 2)] for i in range(3 * len(per_hop))]
        out = [Sample(nodes=t) for t in torch.split(nodes, node_count)]
        for h, (src, dst, eid, groups, *_rest) in enumerate(per_hop):
            edges, before, after = hop_sizes[3 * h], hop_sizes[3 * h + 1], hop_sizes[3 * h + 2]
            srcs, dsts = torch.split(src, edges), torch.split(dst, edges)
            eids = torch.split(eid, edges) if eid is not None else [None] * n_batch
            if groups is not None:
                dst_ptrs = torch.split(groups[0], [n + 1 for n in before])
                dst_by_srcs = torch.split(groups[1], edges)
                src_ptrs = torch.split(groups[2], [n + 1 for n in after])
            for b in range(n_batch):
                hop = Hop(srcs[b], dsts[b], after[b], before[b], eids[b])
                if groups is not None:
                    hop.dst_ptr, hop.dst_by_src, hop.src_ptr = dst_ptrs[b], dst_by_srcs[b], src_ptrs[b]
                out[b].hops.append(hop)
        return out

    def __repr__(self) -> str:
        return (f"NeighborSampler(num_nodes={self.num_nodes}, edges={int(self.row.numel())}, fanouts={self.fanouts}, "
                f"device={self.device}, frontier={self.frontier}, hop_kernel={self.hop_kernel})")
