"""The gate: KV admission per decode instance (see admission.py for the idea, main.py for the wiring)."""
