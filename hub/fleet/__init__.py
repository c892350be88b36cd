"""The hub's state of the fleet kept in the process and the loops that keep it: heartbeats
written behind, the learning mode of a restarted hub, the WireGuard peers."""
