"""The hub's planners: pure functions over snapshots (no I/O, no clock of their own);
the reconcilers in hub/ do the I/O around them."""
