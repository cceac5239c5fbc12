"""The stage process (`python -m pyruntime.stage`): its worker, data loop, scheduler, the model's graphs and kernels,
the graph cache, KV blocks and sampling. It never imports the engine: the two meet only through rings and the
control channel (pyruntime/protocol.py)."""
