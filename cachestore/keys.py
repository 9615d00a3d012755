"""Keys of the cachestore: a block is one (tenant, job, layer, kv-head); a job is (tenant, job).

The tenant is part of every key, so a lookup made for tenant A can never match a block
written for tenant B. Validation messages name the request field they come from.
"""
from __future__ import annotations

from dataclasses import dataclass


def check_job(tenant: str, job_id: str, prefix: str = "") -> None:
    """Raise ValueError ("<prefix>tenant: must not be empty") for an unusable job identity."""
    if not tenant:
        raise ValueError(f"{prefix}tenant: must not be empty")
    if not job_id:
        raise ValueError(f"{prefix}job_id: must not be empty")


@dataclass(frozen=True, order=True)
class JobKey:
    tenant: str
    job_id: str

    def __post_init__(self):
        check_job(self.tenant, self.job_id)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.job_id}"


@dataclass(frozen=True, order=True)
class BlockKey:
    tenant: str
    job_id: str
    layer: int
    kv_head: int

    def __post_init__(self):
        check_job(self.tenant, self.job_id, prefix="key.")
        if self.layer < 0:
            raise ValueError(f"key.layer: must be >= 0, got {self.layer}")
        if self.kv_head < 0:
            raise ValueError(f"key.kv_head: must be >= 0, got {self.kv_head}")

    @property
    def job(self) -> JobKey:
        return JobKey(self.tenant, self.job_id)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.job_id}/L{self.layer}/H{self.kv_head}"
