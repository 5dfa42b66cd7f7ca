"""Pallas GPU kernels, one file per kernel, each with a jnp reference of itself."""
