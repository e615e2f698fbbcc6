"""Reports over finished runs: tables and plots."""
