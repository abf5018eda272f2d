"""Whole-step training programs: ``ember.compile_step`` / ``@ember.train_step`` (train/step.py),
captured as one CUDA graph per step on CUDA (train/capture.py)."""

from ember.train.step import TrainStep, WholeStepReport, compile_step, train_step

__all__ = ["TrainStep", "WholeStepReport", "compile_step", "train_step"]
