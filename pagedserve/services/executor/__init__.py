"""The model executor: owns the accelerator, the weights and the KV tensors; runs a frontend's steps in order."""
