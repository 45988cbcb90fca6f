"""Control: scheduling policies as pure code (facts in, actions out), the water level
and placement. Imports nothing from serving or learning, nor torch or asyncio, so the
simulator drives the very code the scheduler daemon runs."""
