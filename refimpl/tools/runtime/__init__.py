"""Runtime guards."""
