"""From budget to payload (method §5): the affordable set and its envelope, the routed sub-supernet, its wire format."""
