"""Triton GPU kernels for the gradfuse:: ops (placeholder until the Triton issue lands)."""
