"""The versioned file format: header and array layout, sample trees, batch headers, handle records, limits and
trusted roots. Reads defensively and never unpickles unless asked."""
