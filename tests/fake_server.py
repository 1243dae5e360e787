"""Old path of tests/support/fake_server.py, kept only while tests/session/test_binding.py
(owned by the session rework) still imports ``..fake_server``; delete once it imports
``..support.fake_server``."""

from .support.fake_server import FakeServer, server_read_locks, slot_geometry

__all__ = ["FakeServer", "server_read_locks", "slot_geometry"]
