"""Capture: TorchDynamo frames -> FX graphs -> AOTAutograd forward/backward ATen graphs."""
