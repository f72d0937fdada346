"""Tools on top of the public API: CLI, bench, peers."""
