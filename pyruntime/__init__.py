"""pyruntime: an LLM split across the devices of one host, stages joined by shared-memory rings."""
from pyruntime.errors import PyruntimeError

__all__ = ["Launcher", "PyruntimeError"]


def __getattr__(name: str):
  # Importing the launcher pulls in tinygrad-free code only, but keep `import pyruntime` instant.
  if name == "Launcher":
    from pyruntime.engine.launcher import Launcher
    return Launcher
  raise AttributeError(name)
