"""Secure aggregation per routed segment: fixed-point encoding (``fixed``), the cryptography (``keys``) and one
round's stages on the devices and the server (``protocol``). The server learns each routed segment's sum over at
least c + 2 devices, never one device's update."""
