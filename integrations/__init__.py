"""Integrations of kvflow into inference engines, importable as `kvflow.integrations.<name>`."""
