"""Benchmarks of tracedump's cost to the host (``make bench``); not part of the installed package."""
