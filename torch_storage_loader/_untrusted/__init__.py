"""Input from untrusted writers, beside the format that reads it: ``bounded`` (JSON parsed only within
bounds on size, nesting and values) and ``trust`` (the trusted roots a network handle must lie under)."""
