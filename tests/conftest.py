"""Test-wide settings: keep UCX (inside NIXL) on loopback, and NIXL's log quiet.

Set before any test imports NIXL, and inherited by the engine processes tests start.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
