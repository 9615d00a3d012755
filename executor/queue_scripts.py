"""The Redis job queue's keys and its Lua scripts (atomic across executors, safe to retry).

    kvplan:jobs                 stream + consumer group: an entry per job claimed and not finished
                                (a dead executor's entries are re-claimed with XAUTOCLAIM)
    kvplan:wait:{tenant}        list: the tenant's jobs waiting to be claimed, oldest first
    kvplan:waiting              set: tenants with jobs waiting
    kvplan:nwaiting             jobs waiting, all tenants
    kvplan:seq                  submissions so far: a job's `seq` orders the tenants' heads by arrival
    kvplan:submitted            stream (capped): one entry per submission, what an idle claimer waits on
    kvplan:job:{id}             hash: request, status, attempts, cancel, tenant, cost, seq
    kvplan:job:{id}:events      stream of JobEvents
    kvplan:queued               hash: tenant -> jobs waiting or running
    kvplan:rate:{tenant}        submissions this minute

A job waits in its tenant's list until an executor takes it (`TAKE`: the head the fairness policy
chose moves into the stream, read by that executor's consumer in the same script), so which
tenant goes next is decided at claim time (`executor.fairness`), not by arrival order.
"""
from __future__ import annotations

STREAM = "kvplan:jobs"
QUEUED = "kvplan:queued"
WAITING = "kvplan:waiting"
NWAITING = "kvplan:nwaiting"
SEQ = "kvplan:seq"
SUBMITTED = "kvplan:submitted"
SUBMITTED_MAXLEN = 1000


def job_key(job_id: str) -> str:
    return f"kvplan:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"kvplan:job:{job_id}:events"


def wait_key(tenant: str) -> str:
    return f"kvplan:wait:{tenant}"


# KEYS: stream, job, queued, wait list, waiting, nwaiting, submitted, seq.
# ARGV: job_id, request, status, tenant, max_queued, max_per_tenant, cost, submitted maxlen
SUBMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 0} end
local queued = redis.call('XLEN', KEYS[1]) + tonumber(redis.call('GET', KEYS[6]) or '0')
if tonumber(ARGV[5]) > 0 and queued >= tonumber(ARGV[5]) then return {1, queued} end
local mine = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
if tonumber(ARGV[6]) > 0 and mine >= tonumber(ARGV[6]) then return {2, mine} end
redis.call('HSET', KEYS[2], 'request', ARGV[2], 'status', ARGV[3], 'attempts', 0, 'tenant', ARGV[4], 'cost', ARGV[7],
           'seq', redis.call('INCR', KEYS[8]))
redis.call('RPUSH', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('INCR', KEYS[6])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[8], '*', 'job_id', ARGV[1])
return {0, 0}
"""

# KEYS: stream, queued, nwaiting. ARGV: tenant -> {jobs waiting or running, the tenant's}: a cheap look
# before a submission's work (SUBMIT checks the bounds again, atomically, when it writes)
ROOM = """
local queued = redis.call('XLEN', KEYS[1]) + tonumber(redis.call('GET', KEYS[3]) or '0')
return {queued, tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')}
"""

# KEYS: waiting. -> {tenant, job_id, cost, seq, ...}: the head of every tenant's wait list
HEADS = """
local out = {}
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local head = redis.call('LINDEX', 'kvplan:wait:' .. tenant, 0)
  if head then
    local got = redis.call('HMGET', 'kvplan:job:' .. head, 'cost', 'seq')
    table.insert(out, tenant); table.insert(out, head); table.insert(out, got[1] or '1'); table.insert(out, got[2] or '0')
  else
    redis.call('SREM', KEYS[1], tenant)
  end
end
return out
"""

# KEYS: wait list, waiting, nwaiting, stream. ARGV: job_id, tenant, group, consumer
# -> {entry id, job_id, tenant} of the entry this consumer now holds, or {} if the head moved
TAKE = """
if redis.call('EXISTS', KEYS[4]) == 0 then return redis.error_reply('NOGROUP the job stream is gone') end
if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[1] then return {} end
redis.call('LPOP', KEYS[1])
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[2]) end
if redis.call('DECR', KEYS[3]) < 0 then redis.call('SET', KEYS[3], 0) end
redis.call('XADD', KEYS[4], '*', 'job_id', ARGV[1], 'tenant', ARGV[2])
local got = redis.call('XREADGROUP', 'GROUP', ARGV[3], ARGV[4], 'COUNT', 1, 'STREAMS', KEYS[4], '>')
local entry = got[1][2][1]
local fields = {}
for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
return {entry[1], fields['job_id'], fields['tenant'] or ''}
"""

# KEYS: stream, job, events, queued. ARGV: group, entry id, ttl, tenant
FINISH = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
if acked == 1 and redis.call('HINCRBY', KEYS[4], ARGV[4], -1) <= 0 then redis.call('HDEL', KEYS[4], ARGV[4]) end
return acked
"""

# KEYS: the tenant's rate key. ARGV: limit. -> 0, or seconds until the window ends
RATE = """
local n = redis.call('INCR', KEYS[1])
local ttl = redis.call('TTL', KEYS[1])
if ttl < 0 then redis.call('EXPIRE', KEYS[1], 60); ttl = 60 end
if n > tonumber(ARGV[1]) then return ttl end
return 0
"""
