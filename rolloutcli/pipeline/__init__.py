"""One job per command: blocks within the memory budget, progress, atomic outputs; returns plain summaries."""
