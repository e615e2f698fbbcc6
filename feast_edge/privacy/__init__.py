"""Client-level differential privacy for routed slices: clipping, per-coordinate noise, accounting (docs/privacy.md)."""
