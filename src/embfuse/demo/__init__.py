"""`embfuse demo`: data, model and training loop."""
