"""``python -m feast_edge.cli``: the ``feast-edge`` command."""

from feast_edge.cli.main import main

main()
