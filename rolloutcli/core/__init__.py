"""Pure functions on tensors: no files, no printing, no global RNG."""
