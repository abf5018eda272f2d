"""Who imports torch in a compile worker that compiles for the parent's target without it.

    EMBER_COMPILE_WORKER=1 PYTHONPATH=src python benchmarks/scripts/worker_torch_importer.py

Runs a worker's start (``precompile._start_worker``) with an import hook that prints the stack
of the first ``import torch``, and the seconds the start took.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time
import traceback


class _Report(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name == "torch":
            print("torch imported from:\n" + "".join(traceback.format_stack(limit=25)[:-1]), flush=True)
            sys.meta_path.remove(self)
        return None


def main() -> None:
    os.environ.setdefault("EMBER_WORKER_TRITON_TARGET", "cuda:90:32")
    sys.meta_path.insert(0, _Report())
    began = time.perf_counter()
    from ember.runtime import precompile
    precompile._start_worker(0)
    print(f"worker start {time.perf_counter() - began:.3f} s; torch imported: {'torch' in sys.modules}")


if __name__ == "__main__":
    main()
