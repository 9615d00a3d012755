"""Errors of the HTTP API: an executor's gRPC status as the HTTP status and OpenAI-shaped body a
client of OpenAI's API expects (the `openai` client maps them to its exceptions, and retries
only 408, 409, 429 and 5xx), and a job that ended without a result."""
from __future__ import annotations

import grpc

from kvplan import openai_api as api
from kvplan.openai_errors import ApiError, bad
from protos import executor_pb2 as pb

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def from_grpc(e: grpc.aio.AioRpcError) -> ApiError:
    """An executor error as the HTTP error a client of OpenAI's API expects. RESOURCE_EXHAUSTED
    with `retry-after` (a queue bound, a rate) is 429; without (a message over gRPC's limit, a
    job the whole KV budget could never hold) it is 413: retrying cannot help, and 429 made the
    `openai` client send it again."""
    status = HTTP_STATUS.get(e.code(), 500)
    details = e.details() or e.code().name
    retry = dict(e.trailing_metadata() or ()).get("retry-after")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not retry:
        status = 413
    param = None
    if status == 400:
        field, sep, rest = details.partition(": ")
        if sep and " " not in field:
            param = api.PARAMS.get(field, field)
            details = f"{param}: {rest}"
    if status == 503:
        details += " (is the executor up? `kvplan up` starts a local cluster)"
    return ApiError(status, details, param=param, code=e.code().name.lower(),
                        headers={"Retry-After": str(retry)} if retry else None)


def job_ended(status: pb.JobStatus) -> ApiError:
    """A job that ended CANCELLED (409), refused as bad input once it was tokenized or planned
    (400 naming the request's parameter: a budget its strategy cannot hold), or FAILED (500,
    with its error)."""
    name = pb.JobState.Name(status.state)
    if status.state == pb.CANCELLED:
        return ApiError(409, f"job {status.job_id} was cancelled", code="job_cancelled")
    if status.error_field:
        param = api.PARAMS.get(status.error_field, status.error_field)
        return bad(param, status.error.removeprefix(status.error_field + ": "))
    return ApiError(500, f"job {status.job_id} ended {name}: {status.error}", code="job_failed")
