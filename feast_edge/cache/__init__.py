"""The variant cache (method §3): fitness, the evolutionary search, and the cached operating points a device can be served."""
