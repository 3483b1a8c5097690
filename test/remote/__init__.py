"""Tests of the remote backend: RemoteEngine against real servers on loopback, and the node on it."""
