"""Helpers for benchmarks and tests: timing with CUDA events, medians, JSON/PNG result files, what pipeline stages
cost the GPU and the host (stages.py).

Importing this package touches no CUDA device and does not import matplotlib.
"""

from ibpcache.testing.stages import StageBusy, StageProfile, stage_busy, union_length
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
    "StageBusy",
    "StageProfile",
    "stage_busy",
    "union_length",
    "add_out_argument",
    "cpu_time",
    "cuda_time",
    "default_out_dir",
    "environment_info",
    "format_table",
    "summarize",
    "write_results",
]
