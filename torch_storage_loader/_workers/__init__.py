"""Loader worker processes: the messages between trainer and workers, the worker loop and the pool."""
