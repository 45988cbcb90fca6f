"""gyre's only NATS JetStream code: the `Bus` client, consumer outcomes, history and taps, subjects, server."""
from bus.client import (
    MAX_EVENT_BYTES,
    OBJECT_THRESHOLD_BYTES,
    Bus,
    BusConfig,
    BusError,
    ConnectError,
    PayloadTooLarge,
    PublishError,
    too_big,
)
from bus.history import Tap
from bus.consumer import Backoff, Delivery, Invalid, Outcome, Retry, classify
from bus.rpc import RequestFailed

__all__ = [
    "MAX_EVENT_BYTES", "OBJECT_THRESHOLD_BYTES", "Bus", "BusConfig", "BusError", "ConnectError", "PayloadTooLarge",
    "PublishError", "Tap", "too_big", "Backoff", "Delivery", "Invalid", "Outcome", "Retry", "classify",
    "RequestFailed",
]
