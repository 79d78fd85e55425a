"""Engines: the synchronous step loop (and, later, the async loop for servers)."""
