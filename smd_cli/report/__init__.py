"""The reproduction report (`smd reproduce`): the paper's tables and claims regenerated from sweeps of runs.

`data` reads the sweeps `smd ablate` wrote (each member's summary and per-step metrics), `claims` holds the
paper's claims with the rule that decides each verdict from the data, `figures` draws the curves and
ablation plots, and `write` assembles `REPORT.md` with its CSVs and PNGs. Library code: no Hydra.
"""
