"""Tensor formats: how one step's logical tensors become files, and are read back."""
