"""Every `gyre bench NAME` command (`handlers.bench.NAME.main`) and the performance
probes (`python -m handlers.bench.probes.NAME`). Imported only by the CLI and tests."""
