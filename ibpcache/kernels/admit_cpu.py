"""CPU twin of ``admit.cu``: the same per-step admission decisions in torch ops, on the same ``AdmitArgs``.

Equal to the kernels up to the order of the copy list and of staging rows (the kernels claim them with atomic
counters, here they follow the sorted positions); which rows are admitted, into which slots, and which are staged
is identical (a GPU test compares the two). ``copy`` moves bytes between host addresses, so it needs CPU buffers.
"""

from __future__ import annotations

import ctypes

import torch

from .admit import (ADMIT_FORCE, FLAG_CAND, FLAG_FREE, FLAG_HIT, FLAG_MISS, FLAG_OK, FREE_KEY, PROTECTED_KEY,
                    STAT_ADMITTED, STAT_HITS, STAT_HOST_BYTES, STAT_REQUESTS, STAT_STAGED, WS_LIST, WS_STAGED, AdmitArgs,
                    advance_fill, rank, sample_slots, sketch_index)

__all__ = ["count", "scan", "rank", "apply", "advance_fill", "copy", "unstage"]

_MAX_WORTH = 0x7FFFFFFF


def _estimate(sketch: torch.Tensor, width: int, x: torch.Tensor) -> torch.Tensor:
    return sketch[sketch_index(x, width)].amin(1).to(torch.int64)


def count(keys: torch.Tensor, a: AdmitArgs, count_sketch: bool, count_stats: bool) -> None:
    valid = (keys >= 0) & (keys < a.n_rows)
    safe = torch.where(valid, keys, a.n_rows)
    if count_sketch and keys.numel():
        idx = sketch_index(safe, a.width)
        ones = valid.to(torch.int32).unsqueeze(1).expand_as(idx).reshape(-1)
        a.sketch.index_add_(0, idx.reshape(-1), ones)
    slot = a.slot_of[safe].to(torch.int64)  # slot_of[n_rows] is the scratch entry, always -1
    hit = valid & (slot >= 0)
    a.last.index_put_((torch.where(hit, slot, a.n_slots),), a.stamp.expand_as(slot))
    a.last[a.n_slots] = 0  # the scratch element keeps no stamp
    if count_stats:
        a.stats[STAT_REQUESTS] += valid.sum()
        a.stats[STAT_HITS] += hit.sum()


def scan(s: torch.Tensor, a: AdmitArgs, admit: int, round: int = 0) -> None:
    n = s.numel()
    a.flags[:n] = 0
    if n == 0:
        return
    first = torch.ones(n, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    ok = first & (s >= 0) & (s < a.n_rows)
    x = torch.where(ok, s, a.n_rows)
    worth = a.prio[x.clamp(max=a.n_rows - 1)] if a.prio is not None else _estimate(a.sketch, a.width, x)
    slot = a.slot_of[x].to(torch.int64)
    hit = ok & (slot >= 0)
    a.freq.index_put_((torch.where(hit, slot, a.n_slots),), worth)
    miss = ok & (slot == -1)
    flags = ok.to(torch.uint8) * FLAG_OK + hit.to(torch.uint8) * FLAG_HIT + miss.to(torch.uint8) * FLAG_MISS
    if admit and a.n_slots > a.n_pinned:
        length = a.host_len[x.clamp(max=a.n_rows - 1)] if a.host_len is not None else torch.full_like(x, a.row_bytes)
        may = miss & (length <= a.slot_bytes)
        bidkey = (worth.clamp(0, _MAX_WORTH) << 32) | torch.arange(n, dtype=torch.int64)
        if int(a.fill) < a.n_slots:  # never-used slots remain: the misses take them in sorted order, no bids
            a.key[:n] = torch.where(may, bidkey, a.key[:n])
            flags += may.to(torch.uint8) * FLAG_FREE
        else:
            v = sample_slots(x, a.stamp, a.samples, a.n_pinned, a.n_slots, round)  # [n, samples]
            held = a.ids[v]
            lv = a.last[v]
            key = torch.where(held < 0, torch.full_like(lv, FREE_KEY),
                              torch.where(lv >= a.protect, torch.full_like(lv, PROTECTED_KEY),
                                          lv if a.lru else a.freq[v]))
            best, arg = key.min(1)  # the first minimal sample, as the kernel's strict < keeps it
            bv = v.gather(1, arg.unsqueeze(1)).squeeze(1)
            vworth = torch.where(a.ids[bv] < 0, torch.full_like(bv, -1), a.freq[bv])
            cand = may & (best < PROTECTED_KEY) & ((worth > vworth) | (admit == ADMIT_FORCE))
            a.bid.scatter_reduce_(0, torch.where(cand, bv, a.n_slots), torch.where(cand, bidkey, -1), "amax")
            a.bid[a.n_slots] = -1
            a.victim[:n] = torch.where(cand, bv, a.victim[:n])
            a.key[:n] = torch.where(cand, bidkey, a.key[:n])
            flags += cand.to(torch.uint8) * FLAG_CAND
    a.flags[:n] = flags


def apply(s: torch.Tensor, a: AdmitArgs, stage: bool) -> None:
    n = s.numel()
    if n == 0:
        return
    f = a.flags[:n]
    miss = (f & FLAG_MISS) != 0
    cand = (f & FLAG_CAND) != 0
    fresh = ((f & FLAG_FREE) != 0) & (a.fill + a.rank[:n] < a.n_slots)
    v = torch.where(fresh, a.fill + a.rank[:n], torch.where(cand, a.victim[:n], a.n_slots))
    take = fresh | (cand & (a.bid[v] == a.key[:n]))
    x = torch.where(miss, s, a.n_rows)
    length = (a.host_len[x.clamp(max=a.n_rows - 1)] if a.host_len is not None
              else torch.full_like(x, a.row_bytes)).to(torch.int32)
    tv = torch.where(take, v, a.n_slots)
    old = a.ids[tv]
    a.ids.index_put_((tv,), x)
    a.freq.index_put_((tv,), a.key[:n] >> 32)
    a.last.index_put_((tv,), a.stamp.expand_as(tv))
    a.slot_of.index_put_((torch.where(take & (old >= 0), old, a.n_rows),), torch.tensor(-1, dtype=torch.int32))
    a.slot_of.index_put_((torch.where(take, x, a.n_rows),), tv.to(torch.int32))
    a.slot_len.index_put_((torch.where(take, tv, a.slot_len.numel() - 1),), length)
    dst = a.slab_base + tv * a.slot_stride
    if stage and a.stage_cap > 0:
        want = miss & ~take
        k = torch.cumsum(want.to(torch.int64), 0) - 1 + a.ws[WS_STAGED]
        a.ws[WS_STAGED] += want.sum()
        staged = want & (k < a.stage_cap)
        ks = torch.where(staged, k, a.stage_cap)
        a.stage_gid.index_put_((ks.clamp(max=a.stage_cap - 1)[staged],), x[staged])
        a.slot_len.index_put_((torch.where(staged, a.n_slots + k, a.slot_len.numel() - 1),), length)
        a.slot_of.index_put_((torch.where(staged, x, a.n_rows),), (-2 - ks).to(torch.int32))
        dst = torch.where(staged, a.stage_base + ks * a.row_bytes, dst)
    else:
        staged = torch.zeros_like(take)
    listed = take | staged
    e = torch.cumsum(listed.to(torch.int64), 0) - 1 + a.ws[WS_LIST]
    sel = e[listed]
    a.list_gid[sel] = x[listed]
    a.list_dst[sel] = dst[listed]
    a.list_len[sel] = length[listed]
    a.ws[WS_LIST] += listed.sum()
    a.slot_of[a.n_rows] = -1
    a.ids[a.n_slots] = -1
    a.stats[STAT_ADMITTED] += take.sum()
    a.stats[STAT_STAGED] += staged.sum()


def copy(a: AdmitArgs, max_entries: int) -> None:
    """Row by row, by address (a host ``memmove`` per row costs about a microsecond: faster here than any
    tensor indexing over every byte)."""
    n = min(int(a.ws[WS_LIST]), max_entries)
    if n == 0:
        return
    gid, length = a.list_gid[:n], a.list_len[:n].to(torch.int64)
    src = (gid * a.row_bytes if a.host_offsets is None else a.host_offsets[gid]) + a.host_base
    move = ctypes.memmove
    for s_, d_, ln in zip(src.tolist(), a.list_dst[:n].tolist(), length.tolist()):
        move(d_, s_, ln)
    a.stats[STAT_HOST_BYTES] += length.sum()


def unstage(a: AdmitArgs) -> None:
    n = min(int(a.ws[WS_STAGED]), a.stage_cap)
    if n:
        a.slot_of[a.stage_gid[:n]] = -1
