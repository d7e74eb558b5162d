"""Shared memory: segments, slot rings and their leases, slot allocation, filling a slot from a file
(SlotFiller), pinning and delivery to a device."""
