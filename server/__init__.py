"""feast-server: the federation server (registry, rounds over MQTT, checkpoints, per-device ONNX export).

It calls the method's round steps in ``feast_edge.route.plans`` and talks to
devices through ``feast_edge.transport``; see docs/protocol.md §7 and docs/deployment.md.
"""
