"""Local data sets, read from disk only."""
