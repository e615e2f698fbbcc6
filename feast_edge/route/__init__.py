"""From budget to payload (SPEC §5): the affordable set and its envelope, the routed sub-supernet, its wire format."""
