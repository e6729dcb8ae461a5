"""The front doors: Pipeline (processes), LocalPipeline (one process), RuntimeConfig and torch-compat names."""
