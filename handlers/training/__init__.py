"""Training daemons' parts: the core's ledger host and the replica loop (DESIGN.md "Training exactly once")."""
