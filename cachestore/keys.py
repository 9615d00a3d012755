"""Keys of the cachestore: a block is one (tenant, job, layer, kv-head); a job is (tenant, job).

The tenant is part of every key, so a lookup made for tenant A can never match a block
written for tenant B. Validation messages name the request field they come from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")    # no whitespace or control characters: safe in logs


def check_job(tenant: str, job_id: str, prefix: str = "") -> None:
    """Raise ValueError ("<prefix>tenant: must not be empty") for an unusable job identity."""
    for name, value in (("tenant", tenant), ("job_id", job_id)):
        if not value:
            raise ValueError(f"{prefix}{name}: must not be empty")
        if not NAME.match(value):
            raise ValueError(f"{prefix}{name}: must match {NAME.pattern}, got {value[:40]!r}")


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
