"""The Redis layer: key names, the field layouts of hashes and stream entries, the Lua scripts and
their typed wrappers, and the embedded server. Nothing outside this package formats a key, reads a
script's reply by position or parses a stream entry."""
