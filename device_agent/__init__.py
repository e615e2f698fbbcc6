"""device_agent: the feast-agent application run on each device (issue 4).

``profiling`` measures a device and derives its MAC budget; the CLI
(``feast-agent profile | run | fetch-model``) calls it and the shared
feast_edge / feast_edge.transport functions. The method itself lives in feast_edge.
"""
