"""The engine core's ZMQ messages, both ways (outputs pushed to an ingress replica, submissions to the core's
intake): a pickled payload behind its HMAC-SHA256 under the ingress replica's key, which travels only over Ray.
Either end unpickles only what the other signed: anyone on the network can reach both sockets. Torch-free (the
ingress imports it)."""

import hmac
import pickle

MAC_BYTES = 32


def signed(key: bytes, message) -> bytes:
    """``message`` pickled, behind its MAC under ``key``."""
    payload = pickle.dumps(message, protocol=5)
    return hmac.digest(key, payload, "sha256") + payload


def verified(key: bytes | None, msg: bytes):
    """What ``signed`` packed, or raises ValueError if ``key`` (None: no key known) did not sign it."""
    mac, payload = msg[:MAC_BYTES], memoryview(msg)[MAC_BYTES:]
    if key is None or not hmac.compare_digest(mac, hmac.digest(key, payload, "sha256")):
        raise ValueError("not signed by the expected key")
    return pickle.loads(payload)
