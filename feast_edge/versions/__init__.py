"""Models as versions: the install gate a device applies to each new served model, the canary draw and promotion
rule, and the registry of versions and installs (method §10.2).

    gate.py      install a version only if not worse than the running one, paired on the device's held-out split
    canary.py    a canary set across budget tiers first; promoted to all unless the canaries regress
    book.py      the registry (SQLite): versions, and every install, refusal and rollback with its figures
"""
