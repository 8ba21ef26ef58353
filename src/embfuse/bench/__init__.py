"""`embfuse bench`: workloads, providers, the roofline, and reporting."""
