"""Sparse aggregation of the returned slices (method §6), and the robust rules."""
