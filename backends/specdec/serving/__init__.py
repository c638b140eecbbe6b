"""Serving on Triton: the decoupled Python backend, request interface, server launcher, client."""
