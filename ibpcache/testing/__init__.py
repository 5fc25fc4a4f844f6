"""Helpers for benchmarks and tests: timing with CUDA events, medians, JSON/PNG result files.

Importing this package touches no CUDA device and does not import matplotlib.
"""

from ibpcache.testing.timing import (
    add_out_argument,
    cpu_time,
    cuda_time,
    default_out_dir,
    environment_info,
    format_table,
    summarize,
    write_results,
)

__all__ = [
    "add_out_argument",
    "cpu_time",
    "cuda_time",
    "default_out_dir",
    "environment_info",
    "format_table",
    "summarize",
    "write_results",
]
