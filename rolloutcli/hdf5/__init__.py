"""The only package that imports h5py: opening, auditing, reading blocks, writing and publishing files."""
