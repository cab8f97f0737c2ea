"""Partitioning solvers."""
