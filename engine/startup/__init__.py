"""Start-up: the Triton kernels a model's step needs, compiled in parallel child processes from a recorded manifest
before the first request instead of one by one inside it."""
