"""The shared model space (method §1-§3): presets, architectures, layouts, analytic cost, the elastic supernet, static extraction."""
