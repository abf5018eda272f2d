"""CUDA-graph replay of compiled programs: the capture rule, the runner, its memory and pools."""
