"""Codegen: Fused groups -> Triton source; kernel plans -> a readable Python program."""
