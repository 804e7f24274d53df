"""Every ZeroMQ message: msgspec Structs, msgpack on the wire. No pickle anywhere.

Who sends what, on which socket (each union below is named after its receiver and is what
that receiver decodes; socket names in common/sockets.py):

    web worker  DEALER -> renderer.sock  ROUTER  (renderer)   RendererIn
        GenerateRequest, CancelRequest, PingRequest
    renderer    ROUTER -> web worker     DEALER               WebIn
        Accepted, Waiting, Started, Delta, Finished, Failed, Health
    renderer    PUSH   -> inference.sock PULL    (inference)  InferenceIn
        Job, CancelJob, InferencePing, LiveQuery
    persister   PUSH   -> inference.sock                      InferenceIn
        SlotFreed, PersisterHello
    inference   PUSH   -> events.sock    PULL    (renderer)   EventsIn
        Begun, Progress, Token, JobDone, JobError, InferenceHealth, LiveState
    persister   PUSH   -> events.sock                         EventsIn
        IndexSnapshot, PersisterState
    inference   PUSH   -> persister.sock PULL    (persister)  PersisterIn
        SaveCheckpoint, Restored, Rejected, InferenceBye
    renderer    PUSH   -> persister.sock                      PersisterIn
        ToolIds, RendererHello

A request: GenerateRequest -> Accepted (or Waiting, then Accepted) -> Job -> Begun
(-> Started), Token... -> Delta... -> JobDone -> Finished. A count_only request is answered
Finished (finish_reason "count") right after tokenizing. Checkpoint rows never travel here: a
SaveCheckpoint names a shared-memory slot (shm/slots.py). Validation of field values
lives with the code that owns the rule (sampling: common/params.py).
"""
from __future__ import annotations

import msgspec

from common.geometry import Geometry
# the values inside the messages, re-exported so that each keeps its one name (m.SamplingParams ...)
from common.message_parts import (ChatMessage, Constraint, IndexEntry, SamplingParams,  # noqa: F401
                                  SavePoint, TokenLogprob, ToolCall, ToolCallDelta, ToolCallFunction, Usage)


# ---------------------------------------------------------------------------------------
# renderer.sock (ROUTER, bound by the renderer) <- every web worker's DEALER. The ROUTER
# identity is the return route; `rid` names the request within it.

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
    count_only: bool = False            # render and tokenize only: Finished("count") with prompt_tokens
    continue_final: bool = False        # the last message is an assistant's text the answer goes on
                                        # from (Anthropic's prefill, vLLM's continue_final_message)
    session_hint: str = ""              # which conversation this is, as the client says (Responses'
                                        # prompt_cache_key, `user`, Anthropic metadata.user_id)
    reasoning_effort: str = ""          # the client's reasoning effort, given to the chat template as
                                        # `reasoning_effort` (gpt-oss's "Reasoning: high"); "": not said
    template_kwargs: str = ""           # JSON object: the request's extra chat template variables
    received: float = 0.0               # time.monotonic() when the web received it (0: unknown);
                                        # the clock is the host's, shared by every process


class CancelRequest(msgspec.Struct, tag="cancel", frozen=True):
    rid: str


class PingRequest(msgspec.Struct, tag="ping", frozen=True):
    rid: str
    about: str = ""                     # a request rid: the answer says whether it is held
    slots: bool = False                 # the answer lists the sessions (GET /slots)


RendererIn = GenerateRequest | CancelRequest | PingRequest


# ---------------------------------------------------------------------------------------
# web worker (DEALER) <- the renderer: a request's answer, in order Accepted (or Waiting
# first), Delta..., Finished or Failed; Health answers a PingRequest.

class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """The prompt rendered, tokenized and fits: the web may commit to a 200 / start SSE."""
    rid: str
    prompt_tokens: int


class Waiting(msgspec.Struct, tag="waiting", frozen=True):
    """The request is held until the server is ready (see Health.detail for what it lacks);
    the web may commit to a 200 / start SSE and send keepalives meanwhile."""
    rid: str
    detail: str = ""


class Started(msgspec.Struct, tag="started", frozen=True):
    """The model began the request (after any queue): how much of the prompt came from the
    cache, known before the first token (Anthropic's message_start reports it)."""
    rid: str
    prompt_tokens: int
    cached_tokens: int


class Delta(msgspec.Struct, tag="delta", frozen=True):
    rid: str
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""                 # a reasoning model's thinking (Harmony's analysis channel)


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
    prompt_tokens: int = 0              # context_length_exceeded: the prompt's tokens ...
    limit: int = 0                      # ... and the context size


class SlotState(msgspec.Struct, frozen=True):
    """A resident session, or the new session of a running job, as the renderer knows it."""
    sid: int                            # 0: a running job's new session (resident once it ends)
                                        # (a running job's own session while the mirror is unknown)
    n_tokens: int                       # held; while a job runs: its prompt and answer so far
    rid: str = ""                       # the job running in it
    n_decoded: int = 0                  # that job's answer tokens so far
    on_disk: int = 0                    # tokens of the longest checkpoint that is a prefix of it


class Health(msgspec.Struct, tag="health", frozen=True):
    rid: str
    ready: bool
    model: str = ""
    n_ctx: int = 0
    device: str = ""
    dtype: str = ""
    detail: str = ""
    holds: bool = False                 # the PingRequest's `about` is queued or running here
    slots: tuple[SlotState, ...] = ()   # asked for: the resident sessions, then running jobs' new ones
    parallel: int = 0                   # jobs that may run at once
    queued: int = 0                     # requests waiting for one of them


WebIn = Accepted | Waiting | Started | Delta | Finished | Failed | Health


# ---------------------------------------------------------------------------------------
# inference.sock (PULL, bound by inference) <- the renderer (one Job at a time, so it always
# knows the live session it plans against) and the persister (slot hand-back).

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
    session: int = 0                    # the resident session to run in (its first `reuse` tokens
                                        # kept); 0: a new one
    source: int = 0                     # with session 0: the resident session whose first `reuse`
                                        # tokens the new one starts from (copied); 0: none
    unsaved: tuple[int, ...] = ()       # resident sessions whose whole state no checkpoint holds:
                                        # evict-saved if they must leave memory for this job
    more: bool = False                  # the renderer held another request to generate when it sent
                                        # this: a job that may share this one's prefill step follows


class CancelJob(msgspec.Struct, tag="cancel_job", frozen=True):
    rid: str
    keep: int = -1                      # >= 0: then cut the live session to this many tokens


class InferencePing(msgspec.Struct, tag="iping", frozen=True):
    rid: str
    seq: int = 0                        # echoed in InferenceHealth


class LiveQuery(msgspec.Struct, tag="live_query", frozen=True):
    """A renderer that does not know the resident sessions' token ids asks for them."""
    rid: str = ""


class SlotFreed(msgspec.Struct, tag="slot_freed", frozen=True):
    slot: int
    seq: int                            # frees the slot only if it still carries this save


class PersisterHello(msgspec.Struct, tag="persister_hello", frozen=True):
    """A (re)started persister: inference sends it the save of every busy slot again (it skips
    those it already did, by slot and seq, and frees them again)."""
    pid: int


InferenceIn = Job | CancelJob | InferencePing | LiveQuery | SlotFreed | PersisterHello


# ---------------------------------------------------------------------------------------
# events.sock (PULL, bound by the renderer) <- inference (a job's progress and tokens, its
# health, the live session) and the persister (the disk index).

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
    stamps: tuple[float, ...] = ()      # the first token only: time.monotonic() when inference
                                        # began the job, had its session in place (restored,
                                        # copied or cut), had its prompt in, and sent this token


class JobDone(msgspec.Struct, tag="job_done", frozen=True):
    rid: str
    reason: str                         # stop | length | cancelled
    live: tuple[int, ...]               # the job's session's token ids after this job
    keep_from: int = 0                  # the shortest prefix > 0 it can be cut to (0: any; KVSession.keep_from)
    # a session with a recurrent state (linear attention): the only prefixes below its length
    # it can be cut to (KVSession.kept_marks); None: any (within keep_from)
    marks: tuple[int, ...] | None = None
    session: int = 0                    # the job's session (0: none is resident any more)
    resident: tuple[int, ...] = ()      # every resident session after this job, least recently used first
    answer_from: int = 0                # as LiveSession.answer_from


class JobError(msgspec.Struct, tag="job_error", frozen=True):
    rid: str
    message: str
    live: tuple[int, ...] = ()
    session: int = 0
    resident: tuple[int, ...] = ()


class InferenceHealth(msgspec.Struct, tag="ihealth", frozen=True):
    rid: str
    n_ctx: int
    vocab_size: int
    device: str
    dtype: str
    live_tokens: int                    # tokens of all resident sessions
    quant_bits: int = 0
    boot: str = ""                      # new for every process: a change means it restarted
    seq: int = 0                        # the InferencePing's
    jobs: tuple[str, ...] = ()          # rids running or queued when the ping was read
    live_sessions: int = 0              # sessions resident in memory
    resident_bytes: int = 0             # their K/V bytes


class InferenceBusy(msgspec.Struct, tag="ibusy", frozen=True):
    """From a thread of the inference process, every BUSY_EVERY_S while one step of its loop (a
    prefill chunk, a decode round, a restore) runs: the loop answers pings only between steps,
    and one step of a large model on a slow CPU can outlast the renderer's silence limit."""
    boot: str
    step_s: float                       # how long the current step has run


class LiveSession(msgspec.Struct, frozen=True):
    """One resident session as the renderer mirrors it."""
    sid: int
    tokens: tuple[int, ...]
    keep_from: int = 0                  # as JobDone.keep_from
    # the prompt length of the job whose answer the session ends with (0: unknown); a prompt
    # that keeps that much continues the same conversation, however short
    answer_from: int = 0
    marks: tuple[int, ...] | None = None   # as JobDone.marks


class LiveState(msgspec.Struct, tag="live_state", frozen=True):
    """inference -> renderer: the resident sessions' token ids, least recently used first.
    rid "": the answer to a LiveQuery (valid only when not busy: no job running or queued).
    rid of a Job: that job was planned against sessions this process does not hold (the
    renderer's mirror was stale, e.g. this process restarted since); it was not run, plan
    it again against `sessions`."""
    rid: str
    boot: str
    sessions: tuple[LiveSession, ...] = ()
    busy: bool = False


class IndexSnapshot(msgspec.Struct, tag="index", frozen=True):
    """The persister's whole index, sent on every change and every few seconds."""
    entries: tuple[IndexEntry, ...]
    version: int


class PersisterState(msgspec.Struct, tag="persister_state", frozen=True):
    """persister -> renderer, once its directory is scanned and whenever a RendererHello
    asks: the index and every tool id it remembers. `boot` changes with every process, so
    a renderer sees a restarted persister (and sends it its own tool ids again)."""
    boot: str
    index: IndexSnapshot
    tool_ids: tuple[tuple[str, bytes], ...] = ()


EventsIn = (Begun | Progress | Token | JobDone | JobError
    | InferenceHealth | InferenceBusy | LiveState | IndexSnapshot | PersisterState)


# ---------------------------------------------------------------------------------------
# persister.sock (PULL, bound by the persister) <- inference (checkpoints in shared-memory
# slots, restore outcomes) and the renderer (tool ids for KTM sections, hello).

class SaveCheckpoint(msgspec.Struct, tag="save", frozen=True):
    slot: int
    seq: int                            # must equal the slot's trailer (shm.slots) to be written
    slot_path: str
    nbytes: int                         # body bytes in the slot (shm.slots.body_bytes)
    tokens: tuple[int, ...]             # the checkpoint's token ids (also in the slot)
    reason: int
    geometry: Geometry                  # the session's: the payload head the file gets
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
