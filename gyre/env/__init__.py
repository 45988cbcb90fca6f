"""Environment of an execution: harness profiles and their configurations, the
sandbox that confines a harness, and task sets with their evaluators."""
