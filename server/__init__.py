"""feast-server: the federation server (registry, rounds over MQTT, checkpoints, per-device ONNX export).

It runs the run loop (``feast_edge.run.loop``) with FEAST's strategy (``feast_edge.run.strategy``) and talks to
devices through ``feast_edge.transport``; see docs/protocol.md §7 and docs/server.md.
"""
