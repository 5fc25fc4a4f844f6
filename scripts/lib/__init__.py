"""Code that benchmarks and tests share but the library does not need: the SmolLM2 GGUF finder
(``models``) and the nvCOMP baseline (``nvcomp_baseline``). Import as ``scripts.lib.<name>`` from the
repository root."""
