"""The public API: `from pyruntime.launcher import Launcher` and the events a stream yields (Delta, Logits, Done with
its Usage and Timings). The launcher lives in pyruntime/engine/launcher.py, its events in pyruntime/engine/events.py."""
from pyruntime.engine.events import Delta, Done, Logits, Timings, Usage
from pyruntime.engine.launcher import Launcher

__all__ = ["Launcher", "Delta", "Done", "Logits", "Timings", "Usage"]
