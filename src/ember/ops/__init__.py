"""Ember's hand-written kernels and custom ops (max pooling, reflection padding, nearest upsampling)."""
