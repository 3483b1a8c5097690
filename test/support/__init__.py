"""Helpers of the tests (no tests here): import them as ``support.<module>`` (conftest.py says why)."""
