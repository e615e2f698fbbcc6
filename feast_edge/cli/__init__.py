"""The console-script layer: ``feast-edge`` (``main``), and what it shares with ``feast-server`` and ``feast-agent`` (``common``).

Imports run one way: core (``feast_edge.*``) ← transport (``feast_edge.transport``)
← protocol (``feast_edge.protocol``) ← apps (``feast_edge.server``,
``feast_edge.agent``) ← console scripts (this package and the apps' ``cli`` modules).
"""
