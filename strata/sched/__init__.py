"""The scheduler: requests, slots and the window planner. Plans only: it is given an Executor (strata/plan.py)."""
