"""Transfer backends (gyre.transfer.interface): servers and threads that move snapshots."""
