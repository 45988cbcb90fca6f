"""Trajectories: calls arranged as trees, bounded sampling of trajectories, group
advantages, micro-step packing and the builder policy, and synthetic executions."""
