"""What planner and executor both need and neither owns: the cost model of the cache's storage
forms (`kvcore.cost`) and of a plan over a job (`kvcore.plan_cost`). Imports neither."""
