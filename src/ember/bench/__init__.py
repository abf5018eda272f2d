"""Benchmark suite: model registry (``models``), harness (``harness``), result output (``report``).

Kept import-light: the submodules import torch and the optional model packages themselves.
"""

__all__ = ["harness", "models", "nets", "report"]
