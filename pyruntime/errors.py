"""Every named error pyruntime raises, but the HTTP server's own refusals of a request (MalformedRequest, QueueFull,
ServiceUnavailable and its phases, RequestTooLarge, RequestTimeout, ModelNotFound): those exist only as HTTP answers
and live beside the status each maps to, in pyruntime/serving/openai_api.py. A stage's `Fatal`
(pyruntime/stage/worker.py) is not one either: it carries a WorkerFatal reason (docs/control-channel.md) to the launcher.

Each class name is the name used on the wire (WorkerFatal reason codes, C status names, HTTP
error codes), so a caller can match on `type(e).__name__` or `e.code` across process
boundaries without a second table.
"""
from __future__ import annotations


class PyruntimeError(Exception):
  """Base of every pyruntime error. `code` is the stable name of the error."""
  @property
  def code(self) -> str: return type(self).__name__


# --- ring and arena (native/mo_ring.h status codes) -------------------------------------------
class RingError(PyruntimeError): pass
class WouldBlock(RingError): pass
class RingTimeout(RingError): pass
class RingClosed(RingError): pass
class PeerDead(RingError): pass
class RingBusy(RingError):
  """The producer or consumer side of a ring is already claimed by a live process."""

class RecordError(RingError):
  """A consumer found a bad record; the read cursor did not move."""
class EofBeforeFullHeader(RecordError): pass
class InvalidObjectMagic(RecordError): pass
class InvalidObjectHeader(RecordError): pass
class ObjectExtentInvalid(RecordError): pass
class ObjectExtentAlignmentViolation(RecordError): pass
class SequenceViolation(RecordError):
  def __init__(self, expected: int, actual: int):
    super().__init__(f"SequenceViolation: expected sequence {expected}, got {actual}")
    self.expected, self.actual = expected, actual

class OutputError(RingError):
  """A producer refused a payload; nothing was published."""
class OutputExtentInvalid(OutputError): pass
class OutputExtentAlignmentViolation(OutputError): pass
class OutputRingCapacityExceeded(OutputError): pass

class ArenaError(PyruntimeError): pass
class ArenaInvalid(ArenaError):
  """Wrong magic, layout version or size: not an arena of ours, or one of another version."""
class ShmSpaceError(ArenaError):
  """/dev/shm has too little free space for the arena (it would SIGBUS later)."""


# --- payloads and boundaries (docs/wire-format.md, docs/stage-ownership.md) ----------------------------------------------------
class PayloadError(PyruntimeError): pass
class PayloadNotU32Aligned(PayloadError): pass
class ActivationExtentInvalid(PayloadError): pass

class BoundaryError(PyruntimeError): pass
class BoundaryArchitectureMismatch(BoundaryError): pass
class BoundarySchemaMismatch(BoundaryError): pass
class ResultIdentityMissing(BoundaryError): pass
class LayerRangeInvalid(BoundaryError): pass
class TokenIdInvalid(BoundaryError):
  """A token id is outside the vocabulary (head ingress, decoding) or is not an integer."""
class UnsupportedArchitecture(BoundaryError): pass


# --- streams on the rings (pyruntime/protocol.py) ----------------------------------------------
class StreamError(PyruntimeError): pass
class StreamNotOpen(StreamError):
  """A data record names a stream that no OPEN record announced."""
class StreamPositionInvalid(StreamError):
  """A data record's position is not where the stream's KV cache stands."""
class PrefixBlocksInvalid(StreamError):
  """A record names prefix-cache blocks the stage cannot copy (an id outside its blocks, a position out of order)."""
class SlotInvalid(StreamError):
  """An OPEN record names a KV slot outside the stage's slots or one already in use."""


# --- model sources (docs/control-channel.md#model-sources) ----------------------------------------------
class ModelSourceError(PyruntimeError): pass
class GgufLocalPathMissing(ModelSourceError): pass
class GgufDownloadFailed(ModelSourceError): pass
class DefaultModelMissing(ModelSourceError): pass
class ModelLoadFailed(ModelSourceError): pass
class AddressInUse(PyruntimeError):
  """`serve` cannot listen on its host and port (another process has it): found before anything loads."""

class ExtraMissing(PyruntimeError):
  """An option needs an optional extra that is not installed (`pip install 'pyruntime[ray]'`, say)."""


# --- hosts and bridges (docs/hosts.md) -------------------------------------------------------------------------
class BridgeError(PyruntimeError): pass
class BridgeAuthFailed(BridgeError):
  """A peer could not prove it holds the pipeline's secret; it was turned away."""
class BridgeMismatch(BridgeError):
  """The two ends of a bridge differ in package version, ring ABI, model or link; nothing flowed."""
class BridgeRefused(BridgeError):
  """The listener turned this side away (it says why: BridgeAuthFailed, BridgeMismatch) or is not a bridge."""
class BridgeFrameInvalid(BridgeError):
  """A bridge peer sent what is not a frame: an absurd length, a bad MO01 header, a sequence out of order."""
class BridgeLost(BridgeError):
  """A bridge's peer went away: silent for too long, or its connection ended without the end frame."""
class HostMismatch(PyruntimeError):
  """A host of the pipeline runs another pyruntime version or ring ABI, or resolved another model file."""
class PlacementUnavailable(PyruntimeError):
  """The cluster cannot place the pipeline's hosts now (too few nodes, or too few resources on them)."""
class DrafterVocabMismatch(PyruntimeError):
  """A draft model's vocabulary is not the target's (another token's bytes, another special id): its tokens would
  mean other text. Refused at load (docs/speculation.md, "A draft model")."""
class TensorCoresUnavailable(PyruntimeError):
  """The tensor-core mode on a device whose tensor cores cannot take one of its projections: run another way, that
  kernel would sum differently from the same projection at other row counts (docs/prompt-path.md, "Tensor cores")."""

class ServerUnreachable(PyruntimeError):
  """`pyruntime inspect --server URL`: no pyruntime server answered /metrics there."""


# --- generation and serving (docs/serving.md) ---------------------------------------------------------
class GenerationError(PyruntimeError): pass

class InvalidOption(GenerationError):
  """A request field has a bad value. `field` names it."""
  def __init__(self, field: str, message: str):
    super().__init__(f"invalid {field!r}: {message}")
    self.field = field

class EmptyPrompt(InvalidOption):
  def __init__(self, message: str = "the prompt is empty after tokenization"):
    super().__init__("prompt", message)

class ContextLengthExceeded(GenerationError):
  """The prompt leaves no room for one generated token. `at_least`: `prompt_tokens` is a lower bound
  found without tokenizing the whole prompt (refused early because it cannot fit)."""
  def __init__(self, prompt_tokens: int, context: int, *, at_least: bool = False):
    super().__init__(f"the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens but the model's context is {context} tokens; "
                     f"shorten the prompt to at most {context - 1} tokens")
    self.prompt_tokens, self.context, self.at_least = prompt_tokens, context, at_least

class UnsupportedFeature(GenerationError):
  """A request asks for something pyruntime does not do; refused rather than ignored."""
  def __init__(self, feature: str, message: str = ""):
    super().__init__(f"{feature!r} is not supported" + (f": {message}" if message else ""))
    self.feature = feature

class StageFailed(GenerationError):
  """A stage process died or reported WorkerFatal. `stage` is its index, `reason` its code."""
  def __init__(self, stage: int, reason: str, detail: str = ""):
    super().__init__(f"stage {stage} failed: {reason}" + (f": {detail}" if detail else ""))
    self.stage, self.reason, self.detail = stage, reason, detail

class StageStalled(StageFailed):
  """A stage had work and made no progress (no step finished, no record taken) for longer than its bound: stopped,
  deadlocked, a hung device. The launcher ends it like a dead stage."""
  def __init__(self, stage: int, detail: str):
    super().__init__(stage, "StageStalled", detail)

class LauncherClosed(GenerationError): pass

class DriverFailed(StageFailed):
  """The launcher's own driver thread (not a stage) hit a bug outside any one stream: without it nothing is served,
  so the pipeline ends like one whose stage failed, and a server restarts it. `stage` is -1."""
  def __init__(self, cause: BaseException):
    GenerationError.__init__(self, f"the launcher's driver failed: {type(cause).__name__}: {cause}")
    self.stage, self.reason, self.detail = -1, "DriverFailed", f"{type(cause).__name__}: {cause}"

class HostLost(StageFailed):
  """A host of a pipeline placed on several (docs/hosts.md) is gone: its agent died or stopped answering, or a bridge
  to or from it was lost. `host` is its index; `stage` the first of its stages."""
  def __init__(self, host: int, stage: int, reason: str, detail: str):
    super().__init__(stage, reason, detail)
    self.host = host


class StreamFailed(GenerationError):
  """A stage could not compute one stream's record (an ERROR record): that stream alone ends. `reason` is the stage's code."""
  def __init__(self, stage: int | None, reason: str, detail: str = ""):
    super().__init__(f"stage {stage} refused the stream: {reason}" + (f": {detail}" if detail else ""))
    self.stage, self.reason, self.detail = stage, reason, detail


class RequestFailed(GenerationError):
  """The launcher failed one stream on its own side (a bug reached while admitting it or taking its tokens): that
  stream alone ends, with the cause; the slot it held is free and the other streams go on."""
  def __init__(self, where: str, cause: BaseException):
    super().__init__(f"the launcher failed this stream while {where}: {type(cause).__name__}: {cause}")
    self.where, self.cause = where, cause


# --- the stage worker's control channel (docs/control-channel.md) ---------------------------
class WorkerError(PyruntimeError): pass
class GrammarMissing(WorkerError):
  """A structured stream's OPEN reached the tail and its SetGrammar did not follow in time (the launcher sends it first)."""
class UnknownCommand(WorkerError): pass
class InvalidCommand(WorkerError):
  """A known command with missing or malformed arguments."""
class RoleNotConfigured(WorkerError): pass
class WeightsNotLoaded(WorkerError): pass
class RingNotInstalled(WorkerError): pass
class UnsupportedHelperAbi(WorkerError): pass
class NoObjectLoaded(WorkerError):
  """ExecuteStep / ReleaseDeviceObject without a record loaded by RingReadable."""
