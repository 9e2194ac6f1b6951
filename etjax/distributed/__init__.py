"""Scale-out on JAX's own machinery: a (data, model) device mesh (`mesh.py`), the sharding of
weights, KV pages and decode state on it (`placement.py`), and multi-process jobs
(`processes.py`)."""
