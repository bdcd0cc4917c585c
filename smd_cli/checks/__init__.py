"""Is a run what it claims: the lr = 0 parity protocol (`parity`), when a policy has collapsed (`collapse`), the
predicted memory of each phase (`planner`) and the measured one (`profiler`)."""
