"""Typed errors: every failed call raises an ExpertdError subclass for its
gRPC status code, carrying the code, the message and the google.rpc
details the server attached (BadRequest field violations, RetryInfo)."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"
_DETAIL_TYPES = (error_details_pb2.BadRequest, error_details_pb2.RetryInfo,
                 error_details_pb2.ErrorInfo, error_details_pb2.ResourceInfo,
                 error_details_pb2.PreconditionFailure, error_details_pb2.QuotaFailure,
                 error_details_pb2.DebugInfo, error_details_pb2.Help,
                 error_details_pb2.LocalizedMessage)


class ExpertdError(Exception):
    """A call expertd answered with a status other than OK.

    code is the grpc.StatusCode, message the status message, details the
    decoded google.rpc detail messages, field_violations the BadRequest
    (field, description) pairs, and retry_delay the RetryInfo delay in
    seconds (None without one).
    """

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode, message: str, details=(), cause=None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = list(details)
        self.cause = cause

    @property
    def field_violations(self) -> list[tuple[str, str]]:
        return [(v.field, v.description) for d in self.details
                if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations]

    @property
    def retry_delay(self) -> float | None:
        for d in self.details:
            if isinstance(d, error_details_pb2.RetryInfo):
                return d.retry_delay.seconds + d.retry_delay.nanos / 1e9
        return None


class CancelledError(ExpertdError): code = grpc.StatusCode.CANCELLED  # noqa: E701
class UnknownError(ExpertdError): code = grpc.StatusCode.UNKNOWN  # noqa: E701
class InvalidArgumentError(ExpertdError): code = grpc.StatusCode.INVALID_ARGUMENT  # noqa: E701
class DeadlineExceededError(ExpertdError): code = grpc.StatusCode.DEADLINE_EXCEEDED  # noqa: E701
class NotFoundError(ExpertdError): code = grpc.StatusCode.NOT_FOUND  # noqa: E701
class AlreadyExistsError(ExpertdError): code = grpc.StatusCode.ALREADY_EXISTS  # noqa: E701
class PermissionDeniedError(ExpertdError): code = grpc.StatusCode.PERMISSION_DENIED  # noqa: E701
class ResourceExhaustedError(ExpertdError): code = grpc.StatusCode.RESOURCE_EXHAUSTED  # noqa: E701
class FailedPreconditionError(ExpertdError): code = grpc.StatusCode.FAILED_PRECONDITION  # noqa: E701
class AbortedError(ExpertdError): code = grpc.StatusCode.ABORTED  # noqa: E701
class OutOfRangeError(ExpertdError): code = grpc.StatusCode.OUT_OF_RANGE  # noqa: E701
class UnimplementedError(ExpertdError): code = grpc.StatusCode.UNIMPLEMENTED  # noqa: E701
class InternalError(ExpertdError): code = grpc.StatusCode.INTERNAL  # noqa: E701
class UnavailableError(ExpertdError): code = grpc.StatusCode.UNAVAILABLE  # noqa: E701
class DataLossError(ExpertdError): code = grpc.StatusCode.DATA_LOSS  # noqa: E701
class UnauthenticatedError(ExpertdError): code = grpc.StatusCode.UNAUTHENTICATED  # noqa: E701


_BY_CODE = {cls.code: cls for cls in ExpertdError.__subclasses__()}


def _details(metadata) -> list:
    for key, value in metadata or ():
        if key != _DETAILS_KEY:
            continue
        st = status_pb2.Status.FromString(value)
        out = []
        for any_ in st.details:
            for typ in _DETAIL_TYPES:
                if any_.Is(typ.DESCRIPTOR):
                    msg = typ()
                    any_.Unpack(msg)
                    out.append(msg)
                    break
            else:
                out.append(any_)
        return out
    return []


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_status(st: status_pb2.Status) -> ExpertdError:
    """The typed error of a google.rpc.Status, as a call ring completes a
    failed call."""
    code = _CODES.get(st.code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, ExpertdError)
    return cls(code, st.message, _details(((_DETAILS_KEY, st.SerializeToString()),)))


def from_rpc_error(e: grpc.RpcError) -> ExpertdError:
    """The typed error of a grpc.RpcError (sync or aio)."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    try:
        trailers = e.trailing_metadata()
    except Exception:  # noqa: BLE001 - a failed handshake has none
        trailers = None
    cls = _BY_CODE.get(code, ExpertdError)
    return cls(code, details or "", _details(trailers), cause=e)
