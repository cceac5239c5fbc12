"""The launcher's side: planning a pipeline, spawning and watching its stages, the driver's token loop, requests,
events, the prefix cache's index, speculation, hosts. It never imports the stage: the two meet only through rings and
the control channel (pyruntime/protocol.py)."""
