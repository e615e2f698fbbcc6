"""The MQTT transport shared by feast-server and feast-agent (docs/protocol.md); import from its modules.

``topics`` names every topic, ``messages`` holds the validated JSON control
messages, ``chunks`` / ``transfer`` move large payloads in SHA-256-checked
chunks with nacks and receipts, ``link`` is one paho-mqtt 2 connection with
presence, TLS, credentials and reconnects, ``errors`` the exceptions. The
method itself (the core ``feast_edge`` modules) knows nothing about this package.
"""
