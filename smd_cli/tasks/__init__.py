"""Tasks: a dataset, its prompt and its reward (= the evaluation metric). One file per task."""
