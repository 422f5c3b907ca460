"""Pallas GPU kernels for JetSpec-JAX, each beside its pure-JAX reference."""
