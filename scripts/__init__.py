"""Benchmarks and GPU checks of the repository (not installed). A package only so that ``scripts.lib`` is
importable from the repository root (scripts put the root on ``sys.path``; tests/conftest.py does too)."""
