"""`python -m pyruntime.stage`: one pipeline stage process (pyruntime/stage/worker.py)."""
from pyruntime.stage.worker import main

main()
