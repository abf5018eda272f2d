"""The CUDA-graph tests run on a CPU stand-in of the device (support/cudagraph_fakes.py)."""

from cudagraph_fakes import cuda_graphs_on_cpu  # noqa: F401 - a fixture
