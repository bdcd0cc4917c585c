"""Numbers over runs, turned into tables, plots and verdicts. The rule between its two halves: `sweep_tables` draws
one sweep from the rows `smd ablate` has in memory as it finishes (no verdicts), every other module reads finished
sweeps back from disk (`data`) to judge the paper's claims for `smd reproduce`.

`stats` holds means, standard errors and their one formatter (`plus_minus`), and the sequential verdict rules; `data`
reads the sweeps `smd ablate` wrote (each member's summary and per-step metrics), `claims` holds the paper's claims on
the trained policies with the rule that decides each verdict from the data (and which cells an undecided one wants more
seeds for), `machinery` the claims on parity, memory and time, `budget` turns the wanted seeds into `smd ablate`
invocations and predicts their cost, `tables` and `figures` draw the tables and plots, and `write` assembles
`REPORT.md` with its CSVs and PNGs. Library code: no Hydra.
"""
