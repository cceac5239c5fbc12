"""The benchmarks (see README.md here), installed as `pyruntime.bench` (pyproject.toml maps it to this folder):
`pyruntime bench NAME` runs them from a checkout or an installed package alike."""
