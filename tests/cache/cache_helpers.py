"""Helpers shared by the cache tests (id streams and bit-exact comparison)."""

from __future__ import annotations

import torch

__all__ = ["zipf", "uniform", "id_batches", "assert_same_rows", "fetch_from_threads"]


def zipf(n_rows: int, n: int, seed: int) -> torch.Tensor:
    """Skewed ids (Zipf a=1.05, as in the benchmark), duplicates included."""
    from ibpcache.datasets import zipf_ids

    return zipf_ids(n_rows, n, a=1.05, seed=seed)


def uniform(n_rows: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_rows, (n,), generator=gen)


def id_batches(n_rows: int, seed: int = 0) -> list[torch.Tensor]:
    """A mix of batches: skewed, uniform, all ids reversed, one id repeated, a single id."""
    return [
        zipf(n_rows, 1500, seed),
        uniform(n_rows, 1000, seed + 1),
        torch.arange(n_rows - 1, -1, -1),
        torch.full((64,), n_rows // 2, dtype=torch.int64),
        zipf(n_rows, 1500, seed + 2),
        torch.tensor([n_rows - 1]),
    ]


def assert_same_rows(got: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """Bit-exact equality with ``rows[ids]`` (dtype, shape and raw bytes)."""
    want = rows[ids.cpu()]
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    g = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    w = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(g, w), "fetched rows differ from rows[ids]"


def fetch_from_threads(cache, rows: torch.Tensor, n_threads: int = 4, n_fetches: int = 40, batch: int = 2000,
                       streams: bool = False, cpu_ids: bool = False) -> list[str]:
    """Fetch skewed batches from ``n_threads`` Python threads at once (each on its own CUDA stream when
    ``streams``; ids handed over on the CPU, as samplers do, with ``cpu_ids``), as a prefetch thread beside an
    evaluation loop would; return a description of every batch that
    differs from ``rows[ids]`` (an empty list means every concurrent fetch was exact).

    A barrier starts the threads together so their fetches really interleave; each thread checks its own
    batches after its stream has finished them.
    """
    import threading

    n_rows = rows.shape[0]
    barrier = threading.Barrier(n_threads)
    bad: list[str] = []
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            stream = torch.cuda.Stream() if streams else None
            batches = [zipf(n_rows, batch, seed=1000 * t + k) for k in range(n_fetches)]
            outs = []
            barrier.wait()
            ctx = torch.cuda.stream(stream) if stream is not None else _null()
            with ctx:
                for ids in batches:
                    outs.append(cache.fetch(ids.to(cache.device) if streams and not cpu_ids else ids))
            if stream is not None:
                stream.synchronize()
            for k, (ids, got) in enumerate(zip(batches, outs)):
                want = rows[ids].contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(got.cpu().contiguous().reshape(-1).view(torch.uint8), want):
                    bad.append(f"thread {t} batch {k}")
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return bad


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def pool_one_id_bags_both_ways(ids: torch.Tensor, n_rows: int, row_bytes: int, op, elem, psw, src, tables,
                               staging_of, order) -> list[tuple]:
    """One-id bags pooled by ``kernels.lookup.lookup_pool`` twice, as one-id bags (no offsets, bag size 1: the
    kernels with several bags per warp) and as the same bags given as offsets (the bag loop), each with fresh
    counters, freq (without staging) and error words: ``[(out, counters, freq or None, error kind or None)]``.
    ``staging_of()`` makes each run's staging buffer (or None)."""
    from ibpcache.kernels.lookup import LookupErrors, lookup_pool

    n = ids.numel()
    runs = []
    for offsets in (None, torch.arange(n, device="cuda")):
        st = staging_of()
        err = LookupErrors(pin=True)
        out = torch.full((n, row_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        counters = torch.zeros(4, dtype=torch.int64, device="cuda")
        freq = torch.zeros(n_rows, dtype=torch.int32, device="cuda") if st is None else None
        lookup_pool(ids.cuda(), offsets, 1 if offsets is None else 0, n, False, op, elem, psw, out, src, tables,
                    counters, err.ptr, freq=freq, staging=st, bag_order=order)
        torch.cuda.synchronize()
        taken = err.take()
        runs.append((out.cpu(), counters.cpu().tolist(), None if freq is None else freq.cpu().numpy(),
                     None if taken is None else taken[0]))
    return runs
