"""Codegen: fused groups -> Triton or numba kernel source; kernel plans -> a readable Python program.

  lowering.py          each pointwise op and reduction step written once, against a Dialect
  triton_dialect.py    how Triton spells values and ops      cpu_dialect.py   how numba does
  kernel_writer.py     what both kernel writers share: a group's values, scopes, levels
  triton_kernel.py     TritonWriter: tiles, loads, stores     (+ triton_reductions.py, triton_tiles.py)
  cpu_kernel.py        CpuWriter: loops, parameters, units    (+ cpu_reductions.py, cpu_iteration_space.py)
  program.py           the program that runs a plan's steps  (+ memory_plan.py)
Which ops fuse, and on what conditions, is the planner's table (schedule/op_support.py).
"""
