"""Built-in device profiles, shipped as data (``*.json``); ``feast_edge.budget.profile`` finds them by name.

``documented`` regenerates the documented (not measured) profiles from the
figures and sources in ``README.md`` beside it.
"""
