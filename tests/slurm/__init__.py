"""SLURM tests: a real single-node cluster on this machine (see cluster.py)."""
