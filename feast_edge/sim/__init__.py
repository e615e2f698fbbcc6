"""The research harness (method §4, §9): population, set-up, the in-process simulation, --nproc, replay, the methods compared."""
