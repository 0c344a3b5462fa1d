"""What a process says to the node's daemon, and how: protocol, transport, client, residency."""
