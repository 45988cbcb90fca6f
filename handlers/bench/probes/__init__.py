"""Single-purpose performance probes of the proxy's call path; each is run as
`python -m handlers.bench.probes.NAME` and prints what it measured."""
