"""Serving an engine from worker processes: the typed protocol, the worker process, the client every process
that sends requests uses, the worker processes' owner, and the library pool built from them."""
