"""Data-plane transports, importable as `kvflow.transports.<name>`.

Load one by name with `kvflow.transport.load_transport`; backends whose library is missing fail
with an install hint instead of an ImportError.
"""
