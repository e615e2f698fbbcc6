"""``python -m feast_edge.server.cli``: the ``feast-server`` command."""

from feast_edge.server.cli import main

main()
