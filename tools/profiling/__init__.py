"""The profilers behind tools/profiler.py: the decode step on a GPU (step.py: its components, its traced timeline)
and the service's own records (pyspy.py: a py-spy record; timeline.py: its DEBUG log's request timeline)."""
