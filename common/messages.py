"""Every ZeroMQ message, as msgspec Structs (tagged unions per socket). No pickle anywhere."""
from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0
    stop_ids: tuple[int, ...] = ()


def validate_sampling(p: SamplingParams) -> None:
    """Raise ValueError(param, message) for arguments no request may carry."""
    if p.max_tokens < 0:
        raise ParamError("max_tokens", "max_tokens must be >= 0")
    if not (p.temperature >= 0) or p.temperature > 100:
        raise ParamError("temperature", "temperature must be between 0 and 100")
    if not (0 < p.top_p <= 1):
        raise ParamError("top_p", "top_p must be in (0, 1]")
    if p.top_k < 0:
        raise ParamError("top_k", "top_k must be >= 0")
    if not (0 <= p.min_p <= 1):
        raise ParamError("min_p", "min_p must be in [0, 1]")
    if not (0 <= p.top_logprobs <= 20):
        raise ParamError("top_logprobs", "top_logprobs must be between 0 and 20")


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------
# web <-> renderer. Each web worker has one DEALER socket connected to the renderer's
# ROUTER; the ROUTER identity is the return route, `rid` names the request within it.

class ToolCallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str                      # JSON text exactly as the client sent it


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    function: ToolCallFunction
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str                           # system, developer, user, assistant, tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    rid: str
    kind: str                           # "chat" (messages rendered by template) | "completion"
    sampling: SamplingParams
    messages: tuple[ChatMessage, ...] = ()
    prompt: str = ""
    stop: tuple[str, ...] = ()
    tools: str = ""                     # JSON of the OpenAI tools list (validated by web)
    tool_choice: str = ""               # JSON of tool_choice
    logprobs: bool = False
    response_format: str = ""           # JSON: {"type": "json_object"} | {"type": "json_schema", "schema": ...}
    parallel_tool_calls: bool = False   # an answer may hold several calls (else one, then its end)


class CancelRequest(msgspec.Struct, tag="cancel", frozen=True):
    rid: str


class PingRequest(msgspec.Struct, tag="ping", frozen=True):
    rid: str
    about: str = ""                     # a request rid: the answer says whether it is held


RendererIn = GenerateRequest | CancelRequest | PingRequest


class TokenLogprob(msgspec.Struct, frozen=True):
    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """The prompt rendered, tokenized and fits: the web may commit to a 200 / start SSE."""
    rid: str
    prompt_tokens: int


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of a generated tool call: the first piece of call `index` carries id and
    name, later pieces carry fragments of its arguments (JSON text)."""
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class Delta(msgspec.Struct, tag="delta", frozen=True):
    rid: str
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()


class Finished(msgspec.Struct, tag="finished", frozen=True):
    rid: str
    finish_reason: str                  # stop | length | tool_calls | cancelled
    usage: Usage


class Failed(msgspec.Struct, tag="failed", frozen=True):
    rid: str
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    err_type: str = "invalid_request_error"


class Health(msgspec.Struct, tag="health", frozen=True):
    rid: str
    ready: bool
    model: str = ""
    n_ctx: int = 0
    device: str = ""
    dtype: str = ""
    detail: str = ""
    holds: bool = False                 # the PingRequest's `about` is queued or running here


class Waiting(msgspec.Struct, tag="waiting", frozen=True):
    """The request is held until the server is ready (see Health.detail for what it lacks);
    the web may commit to a 200 / start SSE and send keepalives meanwhile."""
    rid: str
    detail: str = ""


WebOut = Accepted | Delta | Finished | Failed | Health | Waiting


# ---------------------------------------------------------------------------------------
# renderer <-> inference: PUSH/PULL each way. The renderer holds the FIFO queue and sends
# one Job at a time, so it always knows the live session it plans against; inference
# re-checks the plan against its own state and falls back to a cold prefill if it differs.

class SavePoint(msgspec.Struct, frozen=True):
    pos: int                            # checkpoint after this many prompt tokens
    reason: int                         # kvfile.COLD / CONTINUED / EVICT / SHUTDOWN


class Constraint(msgspec.Struct, frozen=True):
    """What the answer may be: an llguidance Lark grammar over the generated bytes. With a
    trigger, generation is free until the model writes those bytes; the grammar then
    constrains what follows them. A finished grammar allows only the stop tokens."""
    grammar: str
    trigger: bytes = b""


class Job(msgspec.Struct, tag="job", frozen=True):
    rid: str
    ids: tuple[int, ...]                # the whole effective prompt (also the cold fallback)
    reuse: int                          # planned live-session tokens to keep (prefix of ids)
    sampling: SamplingParams
    restore: str = ""                   # sha1 of a checkpoint to restore instead of the live session
    restore_tokens: int = 0             # its token count, as the index says
    suffix: tuple[int, ...] = ()        # prompt tokens after the restored checkpoint's text
    saves: tuple[SavePoint, ...] = ()   # prompt-side checkpoints (cold, continued)
    evict: bool = False                 # save the whole live session before replacing it
    run_last: bool = False              # run the last sampled token too (a tool call's block
                                        # must be whole in the session and its checkpoints)
    constraint: Constraint | None = None  # masks sampling only: never what is cached


class CancelJob(msgspec.Struct, tag="cancel_job", frozen=True):
    rid: str
    keep: int = -1                      # >= 0: then cut the live session to this many tokens


class InferencePing(msgspec.Struct, tag="iping", frozen=True):
    rid: str
    seq: int = 0                        # echoed in InferenceHealth


class SlotFreed(msgspec.Struct, tag="slot_freed", frozen=True):
    slot: int
    seq: int                            # frees the slot only if it still carries this save


class PersisterHello(msgspec.Struct, tag="persister_hello", frozen=True):
    """A (re)started persister: every slot it may have been reading is free again."""
    pid: int


class LiveQuery(msgspec.Struct, tag="live_query", frozen=True):
    """A renderer that does not know the live session's token ids asks for them."""
    rid: str = ""


InferenceIn = Job | CancelJob | InferencePing | SlotFreed | PersisterHello | LiveQuery


class Begun(msgspec.Struct, tag="begun", frozen=True):
    rid: str
    cached: int                         # tokens actually reused
    prompt_tokens: int
    source: str = "cold"                # live | disk | cold
    detail: str = ""                    # why a planned restore fell back to cold


class Progress(msgspec.Struct, tag="progress", frozen=True):
    rid: str
    done: int
    total: int


class Token(msgspec.Struct, tag="token", frozen=True):
    rid: str
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    finish: str = ""                    # set on the last token: stop | length


class JobDone(msgspec.Struct, tag="job_done", frozen=True):
    rid: str
    reason: str                         # stop | length | cancelled
    live: tuple[int, ...]               # the live session's token ids after this job


class JobError(msgspec.Struct, tag="job_error", frozen=True):
    rid: str
    message: str
    live: tuple[int, ...] = ()


class InferenceHealth(msgspec.Struct, tag="ihealth", frozen=True):
    rid: str
    n_ctx: int
    vocab_size: int
    device: str
    dtype: str
    live_tokens: int
    quant_bits: int = 0
    boot: str = ""                      # new for every process: a change means it restarted
    seq: int = 0                        # the InferencePing's
    jobs: tuple[str, ...] = ()          # rids running or queued when the ping was read


class IndexEntry(msgspec.Struct, frozen=True):
    sha1: str
    text_len: int
    n_tokens: int
    quant_bits: int
    ctx_size: int
    size: int
    last_used: int
    created: int = 0


class IndexSnapshot(msgspec.Struct, tag="index", frozen=True):
    """The persister's whole index, sent on every change and every few seconds."""
    entries: tuple[IndexEntry, ...]
    version: int


class LiveState(msgspec.Struct, tag="live_state", frozen=True):
    """inference -> renderer: the live session's token ids. rid "": the answer to a
    LiveQuery (valid only when not busy: no job running or queued). rid of a Job: that job
    was planned against another live session (the renderer's mirror was stale, e.g. this
    process restarted since); it was not run, plan it again against `tokens`."""
    rid: str
    boot: str
    tokens: tuple[int, ...]
    busy: bool = False


class PersisterState(msgspec.Struct, tag="persister_state", frozen=True):
    """persister -> renderer, once its directory is scanned and whenever a RendererHello
    asks: the index and every tool id it remembers. `boot` changes with every process, so
    a renderer sees a restarted persister (and sends it its own tool ids again)."""
    boot: str
    index: IndexSnapshot
    tool_ids: tuple[tuple[str, bytes], ...] = ()


InferenceOut = (Begun | Progress | Token | JobDone | JobError | InferenceHealth | IndexSnapshot | LiveState
                | PersisterState)


# ---------------------------------------------------------------------------------------
# inference -> persister (PUSH/PULL). The rows travel in a shared-memory slot (shm/).

class SaveCheckpoint(msgspec.Struct, tag="save", frozen=True):
    slot: int
    seq: int                            # must equal the slot's trailer (shm.slots) to be written
    slot_path: str
    nbytes: int                         # body bytes in the slot (shm.slots.body_bytes)
    tokens: tuple[int, ...]             # the checkpoint's token ids (also in the slot)
    reason: int
    ctx_size: int
    chunk_size: int
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: int
    quant_bits: int
    fingerprint: bytes


class Restored(msgspec.Struct, tag="restored", frozen=True):
    sha1: str


class Rejected(msgspec.Struct, tag="rejected", frozen=True):
    sha1: str
    reason: str


class InferenceBye(msgspec.Struct, tag="bye", frozen=True):
    """Inference is exiting; no more saves will come."""
    pid: int


class ToolIds(msgspec.Struct, tag="tool_ids", frozen=True):
    """renderer -> persister: new tool-call ids and their exact sampled block, for KTM."""
    entries: tuple[tuple[str, bytes], ...]


class RendererHello(msgspec.Struct, tag="renderer_hello", frozen=True):
    """renderer -> persister: send me your PersisterState (repeated until one arrives)."""
    boot: str


PersisterIn = SaveCheckpoint | Restored | Rejected | InferenceBye | ToolIds | RendererHello


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(union) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(union)
