"""The ground floor every kvplan service stands on, imported by `planner`, `executor`,
`cachestore` and the front door `kvplan` alike, importing none of them: the settings (`config`),
the plan contract (`plan`), model loading (`model`, `packed_linear`, `allocator`, `host`), the
serving plumbing (`serving`, `launch`, `auth`, `keyfile`, `channels`, `redis_pool`), and what
planner and executor both need and neither owns — the cost model of the cache's storage forms
(`cost`, `blocks`) and of a plan over a job (`plan_cost`, `offload_budget`), scoring, statistics,
request checks, the attention hook."""
