"""Sparse aggregation of the returned slices (SPEC §6), and the robust rules."""
