"""The engine core's ZMQ messages, both ways (outputs pushed to an ingress replica, submissions to the core's
intake): a pickled payload behind its HMAC-SHA256 under the ingress replica's key, which travels only over Ray.
Either end unpickles only what the other signed: anyone on the network can reach both sockets.

The MAC also covers a header: the message's direction (one key signs both ways, so a message captured on one channel
would otherwise pass on the other), its session (one join of a replica to a core: ``Session``, whose id the replica
makes and gives the core over Ray) and its number in that session. Each end accepts only the current session's
messages, each numbered above the last it accepted (ZMQ PUSH -> PULL keeps one sender's order), so a captured message
replayed, or one of an earlier join, is refused. Both sockets also refuse messages over a size derived from the
engine's limits (``intake_max_bytes``, ``output_max_bytes``); senders split lists to keep to it (``packed``).
Torch-free (the ingress imports it)."""

import hmac
import os
import pickle
import struct

MAC_BYTES = 32
OUTPUT, INTAKE = b"o", b"i"  # core -> replica, replica -> core
SESSION_BYTES = 16
_HEADER = struct.Struct(">c16sQ")  # direction, session id, number (covered by the MAC)

# request bodies the ingress reads at most (LLMConfig.max_request_body_bytes' default; the controller gives the core
# the configured value)
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# message size limits, from what the largest legitimate message can hold (pickle's opcodes counted): a token id is
# at most 5 bytes (BININT), an (id, logprob) pair 16 (with BINFLOAT, TUPLE2, MEMOIZE); a body byte becomes at most 6
# (json.dumps rewrites a guided_json schema: a DEL character, 1 byte, as \u007f; a number 1e15 with its comma, 5
# bytes, as "1000000000000000.0, ", 20)
ID_BYTES, PAIR_BYTES, BODY_EXPANSION = 5, 16, 6
MAX_TOP_LOGPROBS = 20  # (SamplingParams.validate: top_logprobs and prompt_logprobs are at most 20)
# a token's share of an output at most: its id and logprob (or a prompt token's logprob) and its alternatives, in
# their lists and tuple
TOKEN_BYTES = (MAX_TOP_LOGPROBS + 1) * PAIR_BYTES + 8
# the rest of a message: the header, the envelope, a request's id, arrival, finish reason, totals and phases, an error
ENVELOPE_BYTES = 64 << 10


def intake_max_bytes(max_model_len: int, max_request_body_bytes: int) -> int:
    """The intake's limit: one request the engine could accept (a prompt below max_model_len tokens, parameters
    from a body of at most max_request_body_bytes); the ingress sends larger submissions in parts."""
    return ID_BYTES * max_model_len + BODY_EXPANSION * max_request_body_bytes + ENVELOPE_BYTES


def output_max_bytes(max_model_len: int) -> int:
    """A replica's output socket's limit: one request's output at its largest (logprobs with 20 alternatives for
    each of max_model_len tokens: its prompt's, with the first output, and the step's); the core sends a step's
    outputs for more requests in parts."""
    return TOKEN_BYTES * max_model_len + ENVELOPE_BYTES


class Session:
    """One join of an ingress replica to an engine core, at either end: its id (random, made by the replica for each
    ``connect``), how many messages this end signed in it and the number of the last one it accepted."""

    __slots__ = ("id", "sent", "accepted")

    def __init__(self, id: bytes | None = None):
        self.id = os.urandom(SESSION_BYTES) if id is None else id
        self.sent = self.accepted = 0

    def signed(self, key: bytes, direction: bytes, message) -> bytearray:
        """``message``, the next of this session in ``direction`` (one thread at a time: the caller's lock or loop)."""
        self.sent += 1
        return signed(key, direction, self.id, self.sent, message)

    def accepts(self, session: bytes, number: int) -> bool:
        """Whether a verified message of ``session`` numbered ``number`` is this session's next (counted if so): not
        another session's, not one accepted before (a replay)."""
        if session != self.id or number <= self.accepted:
            return False
        self.accepted = number
        return True


def signed(key: bytes, direction: bytes, session: bytes, number: int, message) -> bytearray:
    """``message`` pickled behind its header, and both behind their MAC under ``key``."""
    buf = bytearray(MAC_BYTES) + _HEADER.pack(direction, session, number)
    buf += pickle.dumps(message, protocol=5)  # (one copy of the pickle, as a concatenation would make)
    buf[:MAC_BYTES] = hmac.digest(key, memoryview(buf)[MAC_BYTES:], "sha256")
    return buf


def verified(key: bytes | None, msg: bytes, direction: bytes) -> tuple[bytes, int, object]:
    """(session id, number, message) of what ``signed`` packed for ``direction``; raises ValueError if ``key`` (None:
    no key known) did not sign it, or signed it for the other direction."""
    view = memoryview(msg)
    body = view[MAC_BYTES:]
    if key is None or len(body) < _HEADER.size or not hmac.compare_digest(view[:MAC_BYTES],
                                                                          hmac.digest(key, body, "sha256")):
        raise ValueError("not signed by the expected key")
    way, session, number = _HEADER.unpack_from(body)
    if way != direction:
        raise ValueError("signed for the other direction")
    return session, number, pickle.loads(body[_HEADER.size:])


def packed(sign, items: list, limit: int, wrap=None) -> tuple[list[bytearray], list]:
    """``items`` in order as signed messages (``sign(wrap(part))``) of at most ``limit`` bytes each: one message in
    the common case, else halves until each fits; with the items that alone are over ``limit`` (left out)."""
    msg = sign(items if wrap is None else wrap(items))
    if len(msg) <= limit:
        return [msg], []
    if len(items) <= 1:
        return [], list(items)
    half = len(items) // 2
    first, over = packed(sign, items[:half], limit, wrap)
    rest, more = packed(sign, items[half:], limit, wrap)
    return first + rest, over + more
