"""A device's budget: device profiles, their latency and memory limits, and the MAC budget they imply."""
