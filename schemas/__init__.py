"""Versioned, validated bus events (standard library and orjson only)."""
from schemas.base import (
    SCHEMA_VERSION, Event, SchemaError, decode, decode_part, encode, encode_part, event_types, utc_now,
)
from schemas.call import CallCompleted, CallTokens, SamplingParams
from schemas.cell import CellSwitch, CellSwitched, KvBlock, KvOffered, KvPulled, Route, RouteUpdated
from schemas.execution import (
    ExecutionDispatched,
    ExecutionFinished,
    ExecutionInfo,
    ExecutionScored,
    ExecutionStarted,
)
from schemas.step import (
    ClaimReply, ContributionReturned, MicrostepClaim, MicrostepCommitted, MicrostepExecution, MicrostepGranted,
    MicrostepReady, StepCompleted, StepFailed, StepSealed, WeightsLoaded, WeightsPublished,
)

__all__ = [
    "SCHEMA_VERSION", "Event", "SchemaError", "decode", "decode_part", "encode", "encode_part", "event_types", "utc_now",
    "CallCompleted", "CallTokens", "SamplingParams",
    "CellSwitch", "CellSwitched", "KvBlock", "KvOffered", "KvPulled", "Route", "RouteUpdated",
    "ExecutionDispatched", "ExecutionFinished", "ExecutionInfo", "ExecutionScored", "ExecutionStarted",
    "MicrostepExecution", "MicrostepReady", "StepCompleted", "StepSealed", "WeightsLoaded", "WeightsPublished",
    "ClaimReply", "ContributionReturned", "MicrostepClaim", "MicrostepCommitted", "MicrostepGranted", "StepFailed",
]
