"""The router: OpenAI-compatible HTTP API in front of the gate, prefill and decode services."""
