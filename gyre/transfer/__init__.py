"""Bulk bytes between processes (DESIGN.md "Weight publication"): the transfer interface,
manifests and snapshot leases, all pure. Backends that run servers or threads (the loopback
socket; Mooncake) live in `handlers/transfer/`."""
