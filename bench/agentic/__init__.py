"""Agentic-workload benchmark: the public AgentX / weka session trace format, a seeded synthetic
corpus shaped like it, prompt synthesis from hash ids, and (elsewhere in this package) replay."""
