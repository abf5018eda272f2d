"""Runtime: load generated kernels, run generated programs, check them against eager."""
