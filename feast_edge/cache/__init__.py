"""The variant cache (SPEC §3): fitness, the evolutionary search, and the cached operating points a device can be served."""
