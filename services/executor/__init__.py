"""The model executor: owns the accelerator, the weights and the KV tensors; runs one step per call."""
