"""Shared memory: segments, slot rings and their leases, slot allocation, filling a slot from a file
(SlotFiller). The GPU path above it (``_gpu``) reaches receiving through ``slots.gpu``."""
