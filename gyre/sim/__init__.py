"""`gyre sim`: a discrete-event simulator (SimPy) that drives the policies of `gyre.control`
unchanged, on the fixed and random profiles of BENCHMARKS.md or on a run's trace."""
