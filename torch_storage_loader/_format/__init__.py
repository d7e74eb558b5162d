"""The versioned file format: header and array layout, sample trees and batch headers. Reads
defensively (within ``_untrusted.bounded``'s limits) and never unpickles unless asked."""
