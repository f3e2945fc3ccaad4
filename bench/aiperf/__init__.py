"""`moorage bench aiperf`: NVIDIA AIPerf, a real agentic client, against `moorage up` (SmolLM2).

AIPerf 0.13 runs from its own venv (`env.py`, created on first use), with a Hugging Face tokenizer built
offline from the bundled GGUF and registered as a fake HF cache entry (`tokenizer.py`), over a weka-format
corpus written by `moorage trace synth` (`corpus.py`). `runner.py` builds and runs one `aiperf profile`,
`summary.py` turns its profile_export_aiperf.json into a row, the table and the plot, and `main.py` runs the
whole matrix: pool on and off x each concurrency.
"""
