"""The reproduction report (`smd reproduce`): the paper's tables and claims regenerated from sweeps of runs.

`data` reads the sweeps `smd ablate` wrote (each member's summary and per-step metrics), `claims` holds the
paper's claims on the trained policies with the rule that decides each verdict from the data (and which cells
an undecided one wants more seeds for), `machinery` the claims on parity, memory and time, `budget` turns the
wanted seeds into `smd ablate` invocations and predicts their cost, `tables` and `figures` draw the tables and
plots, and `write` assembles `REPORT.md` with its CSVs and PNGs. Library code: no Hydra.
"""
